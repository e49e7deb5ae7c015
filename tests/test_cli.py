"""Tests for the ``lightning-3d`` CLI and the packaged configs (in-process and through the real entry point in a
subprocess; CPU, world size 1)."""

from __future__ import annotations

import math
import os
import re
import shutil
import subprocess
from importlib import metadata
from pathlib import Path

import pytest
import torch
from lightning.pytorch.utilities.model_summary import get_human_readable_count

from lightning_3d.cli import Lightning3DCLI, build_cli, main, packaged_configs, resolve_config, short_error
from lightning_3d.recipes import GPT
from lightning_3d.recipes.gpt import GPTModel
from tests.conftest import RENDEZVOUS
from tests.launch import ROOT

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
    cli = build_cli(["--model.preset_name=tiny", "--model.sdpa_backends=torch", *synthetic, *quiet(tmp_path)],
                    run=False)
    assert (cli.model.config.vocab_size, cli.model.config.seq_length) == (300, 32)
    assert cli.model.config.sdpa_backends == "torch"  # the model-config fields reach the CLI (recipes/attention.py)


@pytest.mark.parametrize("text,value", [("auto", "auto"), ("true", True), ("false", False), (None, "auto")])
def test_gradient_accumulation_fusion_from_the_command_line(tmp_path, text, value):
    """jsonargparse takes the option's three values (``bool | Literal["auto"]``); left out, it is "auto"."""
    args = [] if text is None else [f"--trainer.strategy.init_args.gradient_accumulation_fusion={text}"]
    cli = build_cli(["--config", "gpt_tiny", *args, *quiet(tmp_path)], run=False)
    assert cli.trainer.strategy.options.gradient_accumulation_fusion == value
    assert type(cli.trainer.strategy.options.gradient_accumulation_fusion) is type(value)


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


# ----- the README's path through the real entry point --------------------------------------------------------
def lightning_3d(*args: str, cwd: Path, expect: int = 0) -> subprocess.CompletedProcess:
    """The installed ``lightning-3d`` console script in a fresh process (as a user runs it)."""
    env = {k: v for k, v in os.environ.items() if k not in RENDEZVOUS}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", COLUMNS="120")
    done = subprocess.run([shutil.which("lightning-3d") or "lightning-3d", *args], cwd=cwd, env=env, text=True,
                          capture_output=True, timeout=600)
    assert done.returncode == expect, (done.returncode, done.stdout[-4000:], done.stderr[-4000:])
    return done


def test_readme_path_fit_validate_export_transformers_generate(tmp_path):
    """`fit --config gpt_tiny` (shortened) -> `validate` -> `export` (tokenizer from the checkpoint) -> transformers'
    AutoTokenizer + GPT2LMHeadModel give our model's logits -> generate."""
    from transformers import AutoTokenizer, GPT2LMHeadModel

    from tests.test_hf import reference_logits
    from tests.tolerance import gpt_tolerance, scaled_error

    short = ["--config", "gpt_tiny", f"--data.cache_dir={tmp_path / 'cache'}", "--data.max_corpus_bytes=200000",
             "--data.tokenizer_vocab_size=1024", "--data.seq_length=64", "--data.batch_size=4",
             "--trainer.limit_val_batches=1", f"--trainer.default_root_dir={tmp_path / 'runs'}"]
    fit = lightning_3d("fit", *short, "--trainer.max_steps=3", "--trainer.val_check_interval=3", cwd=tmp_path)
    out = fit.stdout + fit.stderr
    # No noise, no wrong numbers.
    for noise in ("tensorboardX", "Tip:", "LeafSpec", "Epoch 0/-2", "v_num", "Total FLOPs"):
        assert noise not in out, (noise, out[-3000:])
    with torch.device("meta"):  # the whole model, as one process holds it
        config = GPT("tiny", vocab_size=1024, seq_length=64).config
        whole = sum(p.numel() for p in GPTModel(config, config.padded_vocab_size(1)).parameters())
    assert re.search(rf"Total params\W+{re.escape(get_human_readable_count(whole))}\s", out), (whole, out[-3000:])
    assert "Training FLOPs per token" in out
    ckpt = Path(re.search(r"^checkpoint: (.+)$", fit.stdout, re.M).group(1))
    assert ckpt.name == "gpt-tiny-step=3.ckpt" and ckpt.is_dir()

    val = lightning_3d("validate", *short, f"--ckpt_path={ckpt}", cwd=tmp_path)
    assert re.search(r"val_loss\W+\d+\.\d+", val.stdout), val.stdout[-2000:]

    export = lightning_3d("export", "--checkpoint", str(ckpt), "--output", str(tmp_path / "hf"), cwd=tmp_path)
    assert f"tokenizer: {tmp_path / 'hf' / 'tokenizer.json'} (stored in the checkpoint" in export.stdout, export.stdout
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "hf")
    hf = GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()
    text = "def read(path):\n    return open(path).read()"
    ids = tokenizer(text, return_tensors="pt").input_ids
    assert 1 < ids.shape[1] <= 64 and tokenizer.decode(ids[0]) == text  # the tokenizer the model was trained with
    with torch.no_grad():
        theirs = hf(ids).logits
    # fp32, two implementations of the same 4-block network (widest reduction: the 512-wide MLP).
    assert scaled_error(theirs, reference_logits(ckpt, tmp_path, ids)) <= gpt_tolerance(4, 512)
    generated = hf.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    assert generated.shape == (1, ids.shape[1] + 5) and tokenizer.decode(generated[0]).startswith(text)


def test_cli_errors_are_short_with_did_you_mean(tmp_path, capsys, monkeypatch):
    # The parser's messages, in this process (main, what the console script runs): each fresh process costs the
    # imports, and the property here is the message. One real subprocess below covers the entry point's exit path.
    monkeypatch.chdir(tmp_path)

    def refused(*args: str) -> str:
        with pytest.raises(SystemExit) as exc:
            main(["fit", "--config", "gpt_tiny", *args])
        err = capsys.readouterr().err
        assert exc.value.code == 2, err
        return err

    typo = tmp_path / "typo.yaml"
    typo.write_text("trainer:\n  strategy:\n    class_path: lightning_3d.Compressed3DStrategy\n    init_args:\n"
                    "      pipline_parallel_size: 2\n")
    for args in (["--config", str(typo)], ["--trainer.strategy.init_args.pipline_parallel_size=2"]):
        err = refused(*args)
        assert "Option 'pipline_parallel_size' is not accepted; did you mean 'parallelism.pipeline_parallel_size'" in err, err
        assert len(err.splitlines()) <= 3 and "Union" not in err and "usage:" not in err, err
    err = refused("--trainer.max_stepz=2")
    assert "did you mean 'trainer.max_steps'" in err and len(err.splitlines()) <= 3, err
    # gc_interval (YAML / CLI like every strategy option): refused with the strategy's own message.
    err = refused("--trainer.strategy.init_args.gc_interval=0")
    assert "lightning-3d fit: error: lightning_3d.Compressed3DStrategy: `gc_interval=0` must be a positive number of" \
           " optimizer steps" in err, err
    # Through the real entry point: a strategy that refuses its arguments gives its own message, first and alone, and
    # exit code 2 (no traceback).
    bad = ["--trainer.devices=2", "--trainer.strategy.init_args.parallelism.pipeline_parallel_size=2",
           "--trainer.strategy.init_args.pipeline.schedule=1f1b", "--trainer.strategy.init_args.pipeline.num_microbatches=1"]
    err = lightning_3d("fit", "--config", "gpt_tiny", *bad, cwd=tmp_path, expect=2).stderr
    err = "\n".join(line for line in err.strip().splitlines() if not line.startswith("Seed set to"))
    first = err.splitlines()[0]
    assert first.startswith("lightning-3d fit: error: lightning_3d.Compressed3DStrategy: The 1F1B schedule with"
                            " num_microbatches=1"), err
    assert "Traceback" not in err and len(err.splitlines()) <= 2, err


@pytest.mark.parametrize("args,message", [
    (["--trainer.strategy.init_args.parallelism.data_parallel_size=two"],
     "lightning-3d fit: error: trainer.strategy.init_args.parallelism.data_parallel_size='two' is not accepted: it must"
     " be an integer or 'auto' (e.g. --trainer.strategy.init_args.parallelism.data_parallel_size=2)."),
    (["--trainer.accelerator=gpu"], "lightning-3d fit: error: trainer.accelerator='gpu', but this machine has no usable"
     " CUDA GPU"),
    (["--trainer.precision=16-mixed"], "lightning-3d fit: error: trainer.precision='16-mixed' (fp16 with loss scaling)"
     " is not supported by Compressed3DStrategy"),
])
def test_cli_refuses_values_with_one_short_line(tmp_path, capsys, monkeypatch, args, message):
    """A word for an integer option (jsonargparse's nested union report), a GPU on a machine without one (Lightning's
    "No supported gpu backend found!" after the data module was built) and fp16 loss scaling (which Lightning turns
    into bf16 on a CPU): each one line naming the value and the fix, before any class is built."""
    if "accelerator" in args[0] and torch.cuda.is_available():
        pytest.skip("needs a machine without a GPU")
    monkeypatch.chdir(tmp_path)
    built = []
    monkeypatch.setattr(Lightning3DCLI, "instantiate_trainer", lambda self, **kw: built.append(1))
    with pytest.raises(SystemExit) as exc:
        main(["fit", "--config", "gpt_tiny", *args])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.startswith(message), err
    assert len(err.splitlines()) == 2 and "Union" not in err and not built, err


@pytest.mark.parametrize("message,options,expected", [
    ("Subcommand 'fit' does not accept option 'trainer.max_stepz'", ["trainer.max_steps", "trainer.max_epochs"],
     "did you mean 'trainer.max_steps'"),
    ("unrecognized arguments: --data.batch_sise=3", ["data.batch_size", "data.seed"], "did you mean 'data.batch_size'?"),
    ("unrecognized arguments: --zzz=3", ["data.batch_size"], None),
])
def test_short_error_suggestions(message, options, expected):
    short = short_error(message, options)
    assert (expected in short) if expected else (short == message)


# ----- the second hour: every advertised path as written --------------------------------------------------------
def test_help_names_every_command_the_configs_and_the_strategy_options(capsys):
    """`lightning-3d --help` lists export/plan/profile beside Lightning's subcommands; `fit --help` opens with the
    packaged config names and the command that lists the strategy's options, which works."""
    with pytest.raises(SystemExit):
        main(["--help"])
    top = " ".join(capsys.readouterr().out.split())
    for command in ("lightning-3d export --checkpoint", "lightning-3d plan --config", "lightning-3d profile --config"):
        assert command in top, (command, top[-1500:])
    with pytest.raises(SystemExit):
        main(["fit", "--help"])
    head = " ".join(capsys.readouterr().out.splitlines()[:15])
    head = " ".join(head.split())
    assert all(name in head for name in packaged_configs()), head
    assert "lightning-3d fit --trainer.strategy.help Compressed3DStrategy" in head, head
    with pytest.raises(SystemExit):
        main(["fit", "--trainer.strategy.help", "Compressed3DStrategy"])
    assert "--trainer.strategy.parallelism.pipeline_parallel_size" in capsys.readouterr().out


def test_dynamic_microbatching_in_a_pipeline_validates_with_the_default_budget(tmp_path):
    """The config header's `--data.microbatching=dynamic` at pp = 2, no memory_budget_gb (derived from the device),
    through a validation (whose batches carry the planned training order) and with the analytic-cost warning once."""
    fit = lightning_3d("fit", "--config", "gpt_multitask_tiny", "--data.microbatching=dynamic", "--trainer.devices=2",
                       "--trainer.strategy.parallelism.pipeline_parallel_size=2", f"--data.cache_dir={tmp_path / 'cache'}",
                       "--data.num_samples=400", "--trainer.max_steps=3", "--trainer.val_check_interval=2",
                       "--trainer.limit_val_batches=1", f"--trainer.default_root_dir={tmp_path / 'runs'}", cwd=tmp_path)
    out = fit.stdout + fit.stderr
    (metrics,) = (tmp_path / "runs").rglob("metrics.csv")  # the CLI's default logger
    header, *rows = [line.split(",") for line in metrics.read_text().splitlines()]
    assert [math.isfinite(float(r[header.index("val_loss")])) for r in rows if r[header.index("val_loss")]] == [True]
    assert out.count("AnalyticCostModel: costs are estimated") == 1, out[-3000:]
