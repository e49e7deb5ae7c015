"""Tests for the ``lightning-3d`` CLI and the packaged configs (in-process, CPU, world size 1)."""

from __future__ import annotations

import math
from importlib import metadata
from pathlib import Path

import pytest
import torch

from lightning_3d.cli import build_cli, main, packaged_configs, resolve_config

CONFIGS = {"gpt_tiny": 4096, "gpt_125m": 8192, "gpt_350m_3d": 8192, "gpt_1.3b": 8192}


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setattr("sys.argv", ["lightning-3d"])  # the CLI gets its arguments from `args`, not pytest's
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    for key in ("PL_GLOBAL_SEED", "PL_SEED_WORKERS"):  # written by the CLI's seed_everything; removed afterwards
        monkeypatch.setenv(key, "")
        monkeypatch.delenv(key)


def quiet(tmp_path: Path) -> list[str]:
    return [
        f"--trainer.default_root_dir={tmp_path / 'runs'}",
        "--trainer.enable_progress_bar=false",
        "--trainer.enable_model_summary=false",
    ]


def test_console_script_points_at_main():
    scripts = {ep.name: ep.value for ep in metadata.entry_points(group="console_scripts")}
    assert scripts.get("lightning-3d") == "lightning_3d.cli:main"


def test_packaged_configs_are_listed():
    assert set(CONFIGS) <= set(packaged_configs())


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_packaged_config_parses(name, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["fit", "--config", name, "--print_config"])
    assert exc.value.code in (0, None)
    printed = capsys.readouterr().out
    assert "class_path: lightning_3d.Compressed3DStrategy" in printed
    assert "class_path: lightning_3d.recipes.GPT" in printed
    # The data module's vocabulary, which the CLI links into model.vocab_size at instantiation.
    assert f"tokenizer_vocab_size: {CONFIGS[name]}" in printed
    assert "precision: " + ("32-true" if name == "gpt_tiny" else "bf16-mixed") in printed


def test_links_follow_the_data_module(tmp_path):
    args = ["--config", "gpt_tiny", "--data.tokenizer_vocab_size=1000", "--data.seq_length=64", *quiet(tmp_path)]
    cli = build_cli(args, run=False)
    assert cli.model.config.vocab_size == cli.datamodule.vocab_size == 1000
    assert cli.model.config.seq_length == 64
    assert cli.model.hparams.vocab_size == 1000  # also what checkpoints record
    assert type(cli.trainer.strategy).__name__ == "Compressed3DStrategy"

    synthetic = ["--data=lightning_3d.recipes.data.SyntheticLMDataModule", "--data.vocab_size=300", "--data.seq_length=32"]
    cli = build_cli(["--model.preset_name=tiny", *synthetic, *quiet(tmp_path)], run=False)
    assert (cli.model.config.vocab_size, cli.model.config.seq_length) == (300, 32)


def test_any_lightning_module_without_links(tmp_path):
    boring = "lightning.pytorch.demos.boring_classes."
    cli = build_cli([f"--model={boring}BoringModel", f"--data={boring}BoringDataModule", *quiet(tmp_path)], run=False)
    assert type(cli.model).__name__ == "BoringModel"


def test_bare_config_names(tmp_path):
    path = Path(resolve_config("gpt_tiny"))
    assert path.name == "gpt_tiny.yaml" and path.is_file()
    assert resolve_config("gpt_tiny.yaml") == str(path)
    own = tmp_path / "gpt_tiny"  # an existing file always wins over a packaged name
    own.write_text("trainer: {max_steps: 1}\n")
    assert resolve_config(str(own)) == str(own)


def test_unknown_config_name_lists_available(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["fit", "--config", "gpt_nonexistent", "--print_config"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "gpt_nonexistent" in err
    for name in CONFIGS:
        assert name in err
    with pytest.raises(FileNotFoundError, match="gpt_tiny"):
        resolve_config("missing/dir/config.yaml")


def test_fit_then_validate_tiny(tmp_path, single_process):
    common = [
        "--config", "gpt_tiny",
        f"--data.cache_dir={tmp_path / 'cache'}",
        "--data.max_corpus_bytes=200000",
        "--data.batch_size=4",
        "--data.seq_length=64",
        "--trainer.limit_val_batches=1",
        *quiet(tmp_path),
    ]
    fit = build_cli(["fit", *common, "--trainer.max_steps=3", "--trainer.val_check_interval=3"])
    assert fit.trainer.global_step == 3
    fit_val_loss = float(fit.trainer.callback_metrics["val_loss"])
    assert math.isfinite(fit_val_loss)

    log_dir = Path(fit.trainer.log_dir)
    assert (log_dir / "config.yaml").is_file()  # SaveConfigCallback works with the strategy
    checkpoints = sorted((log_dir / "checkpoints").iterdir())
    assert [c.name for c in checkpoints] == ["gpt-tiny-step=3.ckpt"]
    ckpt = checkpoints[0]
    assert ckpt.is_dir() and (ckpt / ".metadata").is_file()  # a sharded checkpoint is a directory

    val = build_cli(["validate", *common, f"--ckpt_path={ckpt}"])
    val_loss = float(val.trainer.callback_metrics["val_loss"])
    # Same held-out batch, same weights: the restored model reproduces the loss of the end of training.
    assert val_loss == pytest.approx(fit_val_loss, rel=1e-5)
    assert torch.distributed.get_world_size() == 1
