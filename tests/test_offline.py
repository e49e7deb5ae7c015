"""No network contact in a default run: ``fit``, ``validate``, ``export`` and ``plan`` of the offline default, in one
process, with the Hugging Face libraries' own offline switches off (as a user's environment has them), under an
audit hook that refuses, and records, any name lookup or socket connection beyond this machine's loopback (the
one-process gloo group's own sockets are loopback)."""

from __future__ import annotations

import ipaddress
import socket
import sys
from pathlib import Path

import pytest

from lightning_3d.cli import build_cli, main

_CONTACTS: list[str] = []
_WATCHING = [False]


def _loopback(host: object) -> bool:
    if host in (None, "", "localhost", b"localhost", socket.gethostname()):
        return True
    try:
        return ipaddress.ip_address(host.decode() if isinstance(host, bytes) else str(host)).is_loopback
    except ValueError:
        return False


def _audit(event: str, args: tuple) -> None:
    if not _WATCHING[0]:
        return
    if event == "socket.getaddrinfo" and not _loopback(args[0]):
        _CONTACTS.append(f"name lookup of {args[0]!r}:{args[1]}")
        raise OSError(f"test_offline: no network contact allowed (lookup of {args[0]!r})")
    if event == "socket.connect":
        sock, address = args
        if sock.family in (socket.AF_INET, socket.AF_INET6) and not _loopback(address[0]):
            _CONTACTS.append(f"connect to {address!r}")
            raise OSError(f"test_offline: no network contact allowed (connect to {address!r})")


sys.addaudithook(_audit)  # audit hooks cannot be removed: it acts only while _WATCHING


@pytest.fixture
def watched(monkeypatch):
    """The libraries' offline switches as in a fresh environment (off), then the audit hook on."""
    import datasets.config
    import huggingface_hub.constants

    for key in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(key, "")
        monkeypatch.delenv(key)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", False)
    monkeypatch.setattr(datasets.config, "HF_UPDATE_DOWNLOAD_COUNTS", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr("sys.argv", ["lightning-3d"])
    _CONTACTS.clear()
    _WATCHING[0] = True
    yield _CONTACTS
    _WATCHING[0] = False


def test_fit_validate_export_and_plan_make_no_network_contact(tmp_path: Path, single_process, watched) -> None:
    common = ["--config", "gpt_tiny", f"--data.cache_dir={tmp_path / 'cache'}", "--data.max_corpus_bytes=200000",
              "--data.batch_size=4", "--data.seq_length=64", "--trainer.limit_val_batches=1",
              f"--trainer.default_root_dir={tmp_path / 'runs'}", "--trainer.enable_progress_bar=false",
              "--trainer.enable_model_summary=false"]
    fit = build_cli(["fit", *common, "--trainer.max_steps=2", "--trainer.val_check_interval=2"])
    assert fit.trainer.global_step == 2 and not watched, watched  # the checkpoint save read the corpus again
    (ckpt,) = sorted((Path(fit.trainer.log_dir) / "checkpoints").iterdir())
    build_cli(["validate", *common, f"--ckpt_path={ckpt}"])
    main(["export", "--checkpoint", str(ckpt), "--output", str(tmp_path / "hf")])
    assert (tmp_path / "hf" / "config.json").is_file()
    main(["plan", "--config", "gpt_tiny", "--gpus", "2", "--out", str(tmp_path / "plan.yaml")])
    assert (tmp_path / "plan.yaml").is_file()
    assert not watched, watched


def test_the_offline_switches_are_scoped_to_local_reads() -> None:
    """A user who asks for the Hub elsewhere in the process still reaches it: the switches come back after a read."""
    import datasets.config
    import huggingface_hub.constants

    from lightning_3d.recipes.data.offline import local_files_only

    before = (datasets.config.HF_HUB_OFFLINE, datasets.config.HF_UPDATE_DOWNLOAD_COUNTS,
              huggingface_hub.constants.HF_HUB_OFFLINE)
    with local_files_only():
        assert datasets.config.HF_HUB_OFFLINE and not datasets.config.HF_UPDATE_DOWNLOAD_COUNTS
        assert huggingface_hub.constants.HF_HUB_OFFLINE
    assert (datasets.config.HF_HUB_OFFLINE, datasets.config.HF_UPDATE_DOWNLOAD_COUNTS,
            huggingface_hub.constants.HF_HUB_OFFLINE) == before
