"""The notebooks and the strategy's launch from Jupyter, executed in real Jupyter kernels (nbclient).

- every ``notebooks/*.ipynb`` runs top to bottom without an error, and is stored without outputs;
- 01_quickstart's executed output holds a rendered PNG plot, as a reader sees it;
- the interactive launch (lightning_3d/strategies/notebook.py): one process in the kernel, four forked processes,
  a second fit in the same kernel, a failing worker, each layout's losses equal to the kernel's one-process run
  within 1e-5 relative (fp32 summation order only; the tolerance of tests/test_distributed.py);
- its refusals, in-process with an interactive session simulated (``sys.ps1``, Lightning's own test).
"""

from __future__ import annotations

import base64
import json
import multiprocessing
import os
import re
import signal
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
import torch

from lightning_3d import Compressed3DStrategy
from lightning_3d.strategies.notebook import ForkLauncher, check_can_fork
from lightning_3d.utils.compat import SubprocessScriptLauncher
from tests.launch import ROOT
from tests.scenarios import notebook_launch

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
TOLERANCE = 1e-5  # as tests/test_distributed.py: layouts against one process, fp32, a few steps


def execute(nb, cwd: Path, timeout: int = 600):
    """Run ``nb`` in a fresh python3 kernel started in ``cwd`` (where the notebook writes its runs), importing this
    checkout's package."""
    env = {"PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "OMP_NUM_THREADS": "1",
           "TOKENIZERS_PARALLELISM": "false", "MPLBACKEND": "module://matplotlib_inline.backend_inline"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # the kernel inherits this process's environment
    try:
        # The kernel is stopped at once when the last cell is done: what is checked ran in the cells, and a graceful
        # shutdown's interpreter teardown (torch and Lightning loaded) would only add seconds per notebook.
        nbclient.NotebookClient(nb, timeout=timeout, kernel_name="python3", shutdown_kernel="immediate",
                                resources={"metadata": {"path": str(cwd)}}).execute()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return nb


# ----- the interactive launch ---------------------------------------------------------------------------------------
def test_one_process_four_processes_and_a_second_fit_in_one_kernel(tmp_path: Path) -> None:
    report = tmp_path / "report.json"
    nb = nbformat.v4.new_notebook()
    setup = notebook_launch.SETUP.replace("__ROOT__", repr(str(tmp_path / "logs"))).replace("__REPORT__", repr(str(report)))
    nb.cells = [nbformat.v4.new_code_cell(src) for src in [setup, *notebook_launch.CELLS]]
    execute(nb, tmp_path, timeout=300)
    out = json.loads(report.read_text())
    ref = out["one"]
    assert len(ref) == 4 and out["one_launcher"] == "None"  # one process: the kernel trains, no launcher
    for name in ("four", "second", "again"):
        assert len(out[name]) == 4 and max(abs(a - b) / abs(b) for a, b in zip(out[name], ref)) <= TOLERANCE, (name, out)
    assert out["four_launcher"] == "ForkLauncher" and out["four_state"] == ["fit", "finished"]
    assert out["four_metric"] == pytest.approx(out["four"][-1], rel=1e-6)  # rank 0's callback_metrics came back
    assert out["four_ckpt"].endswith(".ckpt") and out["four_ckpt_exists"]  # ModelCheckpoint's path came back
    assert out["kernel_env_kept"]  # the workers' rendezvous port was set in the workers only
    assert not out["kernel_initialised_after_fork"]  # the kernel's own group was released before forking
    assert out["fds_after_second_fork"] == out["fds_after_first_fork"]  # a forked fit leaves no descriptor behind
    assert "trainer.fit was already called on this Trainer" in out["refit_error"]
    assert out["worker_error"].startswith("ProcessRaisedException"), out["worker_error"]  # raised in the kernel, no hang
    assert "3 * 2 * 1 = 6, but the job has 4 processes" in out["worker_error"], out["worker_error"]  # with the worker's own message
    assert out["children_left"] == 0


@pytest.fixture
def interactive(monkeypatch):
    monkeypatch.setattr(sys, "ps1", ">>> ", raising=False)


def test_interactive_session_gets_no_launcher_for_one_process_and_fork_for_several(interactive) -> None:
    one = pl.Trainer(accelerator="cpu", devices=1, strategy=Compressed3DStrategy(), logger=False)
    assert one.strategy.launcher is None
    four = pl.Trainer(accelerator="cpu", devices=4, strategy=Compressed3DStrategy(), logger=False)
    assert isinstance(four.strategy.launcher, ForkLauncher) and four.strategy.launcher.is_interactive_compatible


def test_script_keeps_the_subprocess_launcher() -> None:
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=Compressed3DStrategy(), logger=False)
    assert isinstance(trainer.strategy.launcher, SubprocessScriptLauncher)


def test_platform_without_fork_is_refused_before_any_process(interactive, monkeypatch) -> None:
    monkeypatch.setattr(torch.multiprocessing, "get_all_start_methods", lambda: ["spawn"])
    with pytest.raises(RuntimeError, match=r"this platform cannot fork \(start methods: spawn\).*devices=1"):
        pl.Trainer(accelerator="cpu", devices=2, strategy=Compressed3DStrategy(), logger=False)


def test_initialised_cuda_is_refused_for_gpu_workers_only(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.raises(RuntimeError, match="CUDA is already initialised.*Restart the kernel"):
        check_can_fork(4, "cuda")
    check_can_fork(4, "cpu")  # CPU workers never touch CUDA


def test_several_nodes_are_refused(interactive) -> None:
    with pytest.raises(RuntimeError, match="cannot start a 2-node job from an interactive session"):
        pl.Trainer(accelerator="cpu", devices=2, num_nodes=2, strategy=Compressed3DStrategy(), logger=False)


def test_an_interrupted_launch_leaves_no_worker_behind() -> None:
    """A cell interrupted while the workers run (KeyboardInterrupt in the kernel): every worker is gone when the
    exception reaches the notebook, and the launcher holds none."""
    strategy = SimpleNamespace(num_processes=2, root_device=torch.device("cpu"),
                               cluster_environment=SimpleNamespace(main_port=0))
    launcher = ForkLauncher(strategy, release=lambda: None)
    pids = multiprocessing.get_context("fork").SimpleQueue()

    def work() -> None:
        pids.put(os.getpid())
        time.sleep(120)

    def interrupt(*_: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGALRM, interrupt)
    signal.alarm(3)
    try:
        with pytest.raises(KeyboardInterrupt):
            launcher.launch(work)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    workers = [pids.get() for _ in range(2)]
    assert launcher.procs == [] and not any(Path(f"/proc/{pid}").exists() for pid in workers)


# ----- the notebooks --------------------------------------------------------------------------------------------
def test_the_tutorial_notebooks_exist() -> None:
    assert {p.stem for p in NOTEBOOKS} >= {"01_quickstart", "02_compression", "03_dynamic_microbatching", "04_planner",
                                          "05_hugging_face"}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_is_stored_without_outputs(path: Path) -> None:
    nb = nbformat.read(path, as_version=4)
    dirty = [i for i, c in enumerate(nb.cells) if c.cell_type == "code" and (c.outputs or c.execution_count)]
    assert not dirty, f"{path.name}: cells {dirty} hold outputs; clear them (see notebooks/README.md)"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_changes_to_gpu_sizes_in_one_cell(path: Path) -> None:
    """The second cell holds the sizes and, in a comment, GPU values that notebooks/check_on_gpus.py applies."""
    sys.path.insert(0, str(ROOT / "notebooks"))
    try:
        from check_on_gpus import gpu_cell
    finally:
        sys.path.pop(0)
    settings = nbformat.read(path, as_version=4).cells[1].source
    namespace: dict = {}
    exec(gpu_cell(settings), namespace)  # our own notebook's cell: plain assignments
    assert namespace["ACCELERATOR"] == "gpu" and namespace["PRECISION"] == "bf16-mixed"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs_top_to_bottom(path: Path, tmp_path: Path) -> None:
    nb = execute(nbformat.read(path, as_version=4), tmp_path)
    pngs = [base64.b64decode(o["data"]["image/png"]) for c in nb.cells if c.cell_type == "code"
            for o in c.outputs if "image/png" in o.get("data", {})]
    if path.stem == "01_quickstart":  # the overlaid loss curves, rendered as a reader sees them
        assert pngs and all(p.startswith(b"\x89PNG\r\n\x1a\n") for p in pngs)
    if path.stem == "04_planner":  # the text under the comparison says what the run showed, not a fixed story
        printed = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)
        low, high, way = re.search(r"measured / predicted (\d+\.\d+)-(\d+\.\d+): measured (slower|faster)", printed).groups()
        assert float(high) > 1 if way == "slower" else float(low) < 1, printed[-800:]
        assert re.search(r"the planner's ranking (matches|differs from) the measured one", printed), printed[-800:]
