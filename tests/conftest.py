import os
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
