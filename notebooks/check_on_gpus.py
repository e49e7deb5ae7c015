"""Execute tutorial notebooks with the GPU sizes of their settings cell, in a real Jupyter kernel (nbclient).

Each notebook's second cell ends with a comment "On a machine with 4 GPUs, for example:" followed by commented
assignments; this script appends them, uncommented, to that cell and runs the notebook top to bottom. Executed
notebooks and a JSON summary (seconds, error) go to ``--out`` (default ``$OUT``, else ``./gpu_check``).

    python notebooks/check_on_gpus.py                      # all five
    python notebooks/check_on_gpus.py notebooks/01_quickstart.ipynb --out /tmp/gpu_check
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import nbclient
import nbformat

HERE = Path(__file__).resolve().parent


def gpu_cell(source: str) -> str:
    lines = source.splitlines()
    start = next(i for i, line in enumerate(lines) if "for example:" in line)
    extra = []
    for line in lines[start + 1:]:
        if not line.startswith("#   "):
            break
        extra.append(line[4:])
    return source + "\n# GPU sizes (check_on_gpus.py):\n" + "\n".join(extra)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("notebooks", nargs="*", type=Path)
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "gpu_check")))
    parser.add_argument("--timeout", type=int, default=1800, help="per cell, seconds")
    args = parser.parse_args()
    paths = args.notebooks or sorted(HERE.glob("[0-9][0-9]_*.ipynb"))
    args.out.mkdir(parents=True, exist_ok=True)
    os.environ["PYTHONPATH"] = f"{HERE.parent}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
    summary = {}
    for path in paths:
        nb = nbformat.read(path, as_version=4)
        nb.cells[1].source = gpu_cell(nb.cells[1].source)
        start, error = time.perf_counter(), None
        try:
            nbclient.NotebookClient(nb, timeout=args.timeout, kernel_name="python3",
                                    resources={"metadata": {"path": tempfile.mkdtemp(prefix="nb_gpu_")}}).execute()
        except Exception as err:  # keep going: report every notebook
            error = f"{type(err).__name__}: {str(err)[-3000:]}"
        summary[path.stem] = {"seconds": round(time.perf_counter() - start, 1), "error": error,
                              "settings": nb.cells[1].source.splitlines()[-3:]}
        nbformat.write(nb, args.out / f"{path.stem}.gpu.ipynb")
        print(path.stem, summary[path.stem]["seconds"], "s", "OK" if error is None else error[:300], flush=True)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2))
    sys.exit(1 if any(v["error"] for v in summary.values()) else 0)


if __name__ == "__main__":
    main()
