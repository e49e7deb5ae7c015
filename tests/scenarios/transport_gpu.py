"""Driver for a 2-GPU machine: the transport's scenarios on NCCL, within a time budget, results under ``--out``.

    L3D_TEST_DEVICE=cuda python -m tests.scenarios.transport_gpu --out "$OUT" --budget 170

Runs, in order of importance, each in 2 processes: ``transport`` (groups, mirrored batches, exact results, with a
two-part codec posted ahead), ``transport --extra cb`` (CB + LEP on every gradient send of a (1, 2, 1) fit, equal to
the uncompressed reference), ``layouts --world 2`` (every 2-process layout and schedule against one process). Each
report, the ranks' logs and ``summary.json`` (per run: report or error, seconds) land in ``--out``; a run that does
not fit the remaining budget is stopped and recorded as such.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from tests.launch import run_scenario

RUNS = (("transport", []), ("transport", ["--extra", "cb"]), ("layouts", ["--world", "2"]))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--budget", type=float, default=170.0)
    parser.add_argument("--only", nargs="+", default=None, help="run only the scenarios of these names")
    args = parser.parse_args()
    if os.environ.get("L3D_TEST_DEVICE") != "cuda":
        raise SystemExit("Set L3D_TEST_DEVICE=cuda: this driver is for the GPU machine.")
    args.out.mkdir(parents=True, exist_ok=True)
    end, summary = time.monotonic() + args.budget, {}
    for index, (name, extra) in enumerate(RUNS):
        if args.only and name not in args.only:
            continue
        key, start = f"{index}_{name}{''.join('_' + a.strip('-') for a in extra)}", time.monotonic()
        left = end - start
        if left < 20:
            summary[key] = {"skipped": "budget spent"}
            continue
        try:
            summary[key] = {"report": run_scenario(2, name, extra, args.out / f"{key}.json", timeout=left)}
        except AssertionError as e:  # the harness's message: which rank failed or that it timed out, with the logs
            summary[key] = {"error": str(e)[-4000:]}
        summary[key]["seconds"] = round(time.monotonic() - start, 1)
        (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
        print(key, "ok" if "report" in summary[key] else "FAILED", summary[key]["seconds"], "s", flush=True)


if __name__ == "__main__":
    main()
