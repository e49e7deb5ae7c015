import multiprocessing
import os
import socket
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

# Some tests use the benchmark scripts' helpers (`benchmarks.*`), however pytest is started.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# Tests never reach a hub: everything they use is made or shipped by the project.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# DataLoader workers start from a fork server (worker_options in lightning_3d/recipes/data/loader.py says why). The
# server imports the data package once, before the suite's first workers, so that each worker it forks has torch and
# Lightning already imported instead of importing them again (most of a worker's start). The workers see the same
# environment either way: a fork server's children inherit the server's, not the test's.
multiprocessing.set_forkserver_preload(["__main__", "lightning_3d.recipes.data"])

RENDEZVOUS = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "LOCAL_WORLD_SIZE",
              "GROUP_RANK", "TORCHELASTIC_RUN_ID")


@pytest.fixture(autouse=True)
def hermetic_environment():
    """In-process Lightning runs write rendezvous variables into os.environ and leave a process group behind;
    undo both so that every test (and every subprocess it starts) begins clean."""
    saved = dict(os.environ)
    yield
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    os.environ.clear()
    os.environ.update(saved)


def clean_env(**extra: str) -> dict[str, str]:
    """os.environ without rendezvous variables, for starting a fresh distributed job."""
    env = {k: v for k, v in os.environ.items() if k not in RENDEZVOUS}
    env.update(extra)
    return env


@pytest.fixture
def single_process(monkeypatch):
    """A free rendezvous port for the 1-process gloo group; env restored and group destroyed afterwards."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    # Lightning's launcher writes these into os.environ; set-then-delete makes monkeypatch
    # remove them again afterwards, so a leftover LOCAL_RANK cannot make later tests look externally launched.
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK"):
        monkeypatch.setenv(key, "")
        monkeypatch.delenv(key)
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture
def flex_on_cpu(monkeypatch):
    """FlexAttention trains on CPU for the test (tests/flex_cpu.py), undone afterwards."""
    from tests.flex_cpu import allow_flex_backward_on_cpu

    allow_flex_backward_on_cpu(monkeypatch.setattr)


@pytest.fixture
def four_rank_trainer(monkeypatch):
    """A stand-in Trainer for ThroughputMFUMonitor units: dp=2 x pp=2 on 4 CPU devices, fitting, logging into the
    returned list; ``time.perf_counter`` reads 100, 101, 103 (two steps 2 s apart after the start)."""
    from types import SimpleNamespace

    import torch
    from lightning.pytorch.trainer.states import RunningStage, TrainerFn

    from lightning_3d import Compressed3DStrategy, ParallelDims

    strategy = Compressed3DStrategy(data_parallel_size=2, pipeline_parallel_size=2, num_microbatches=2,
                                    parallel_devices=[torch.device("cpu")] * 4)
    strategy.dims = ParallelDims(2, 2, 1, 4)
    logged: list[dict] = []
    trainer = SimpleNamespace(
        strategy=strategy, world_size=4, enable_validation=False,
        state=SimpleNamespace(fn=TrainerFn.FITTING, stage=RunningStage.TRAINING),
        fit_loop=SimpleNamespace(_should_accumulate=lambda: False, total_batch_idx=0),
        _logger_connector=SimpleNamespace(should_update_logs=True, log_metrics=lambda m, step=None: logged.append(m)),
    )
    clock = iter([100.0, 101.0, 103.0])
    monkeypatch.setattr("time.perf_counter", lambda: next(clock))
    return trainer, logged
