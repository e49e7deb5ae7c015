"""README.md's code, extracted and run, so it cannot drift from the code: its Python snippets build their real objects
(strategy, data module, model; only the GPU ``Trainer`` is replaced by one that checks its arguments against
Lightning's), the protocol sketch names only methods the protocol, Lightning and examples/own_model.py have, and every
``lightning-3d`` command it shows parses (in-process, ``--print_config``)."""

from __future__ import annotations

import ast
import inspect
import re
import shlex
import sys

import lightning.pytorch as pl
import pytest

from lightning_3d import Compressed3DStrategy, Parallel3DModule
from lightning_3d.cli import main, packaged_configs
from tests.launch import ROOT

README = (ROOT / "README.md").read_text()


def blocks(language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", README, re.S | re.M)


class CheckedTrainer:
    """Stands in for ``pl.Trainer`` (the snippets ask for GPUs): arguments must bind to Lightning's signature."""

    made: list[CheckedTrainer] = []

    def __init__(self, *args, **kwargs) -> None:
        inspect.signature(pl.Trainer.__init__).bind(None, *args, **kwargs)
        self.kwargs, self.fitted = kwargs, None
        CheckedTrainer.made.append(self)

    def fit(self, model, datamodule=None, **kwargs) -> None:
        self.fitted = (model, datamodule)


def test_python_snippets_build_their_objects(monkeypatch):
    python = blocks("python")
    assert len(python) == 3, "README's Python snippets changed: update this test"
    monkeypatch.setattr(pl, "Trainer", CheckedTrainer)
    CheckedTrainer.made.clear()
    exec(compile(python[0], "README.md[python 0]", "exec"), {"Trainer": CheckedTrainer})
    exec(compile(python[1], "README.md[python 1]", "exec"), {})
    first, second = CheckedTrainer.made
    assert isinstance(first.kwargs["strategy"], Compressed3DStrategy)
    assert first.kwargs["strategy"].num_microbatches == 8
    model, data = second.fitted
    assert type(model).__name__ == "GPT" and model.config.vocab_size == data.vocab_size
    assert isinstance(second.kwargs["strategy"], Compressed3DStrategy)


def test_protocol_sketch_matches_the_protocol_and_the_example():
    sketch = ast.parse(blocks("python")[2])
    (cls,) = [node for node in sketch.body if isinstance(node, ast.ClassDef)]
    methods = {f.name for f in cls.body if isinstance(f, ast.FunctionDef)}
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        from own_model import TinyLM
    finally:
        sys.path.remove(str(ROOT / "examples"))
    protocol = {name for name in dir(Parallel3DModule) if not name.startswith("_")}
    lightning = {"configure_model", "training_step"}
    optional = {"check_pipeline_batch", "log_pipeline_loss", "padded_parameters"}
    assert methods <= protocol | lightning | optional, methods - protocol - lightning - optional
    assert protocol - optional <= methods, protocol - optional - methods  # the sketch shows the whole protocol
    assert all(callable(getattr(TinyLM, m, None)) for m in methods)  # and the example implements all of it
    # The helpers the sketch names exist where the README says.
    from lightning_3d.recipes.training import init_full_  # noqa: F401
    from lightning_3d.utils.tensors import materialize_  # noqa: F401

    assert "lightning_3d.recipes.training.init_full_" in README and "lightning_3d.utils.tensors.materialize_" in README
    from lightning_3d.recipes import gpt_from_pretrained, t5_from_pretrained  # noqa: F401  (as the README says)


def commands() -> list[list[str]]:
    lines = [line.split("#")[0].strip() for block in blocks("bash") for line in block.splitlines()]
    found = [shlex.split(line[line.index("lightning-3d"):]) for line in lines if "lightning-3d " in line]
    return [c[1:] for c in found]


@pytest.mark.parametrize("argv", [c for c in commands() if c[0] in ("fit", "validate")], ids=" ".join)
def test_cli_commands_parse(argv, monkeypatch, capsys, tmp_path):
    monkeypatch.setattr("sys.argv", ["lightning-3d"])
    monkeypatch.chdir(ROOT)  # the README's relative config paths are relative to the repository
    argv = [str(tmp_path) if re.fullmatch(r"<[^>]+>", a) else a for a in argv]
    with pytest.raises(SystemExit) as exc:
        main([*argv, "--print_config"])
    assert exc.value.code in (0, None), capsys.readouterr().err
    assert "class_path: lightning_3d.Compressed3DStrategy" in capsys.readouterr().out


def test_export_command_and_configs_exist(capsys):
    exports = [c for c in commands() if c[0] == "export"]
    assert exports
    with pytest.raises(SystemExit):
        main(["export", "--help"])
    usage = capsys.readouterr().out
    for command in exports:
        assert all(option in usage for option in command if option.startswith("--"))
    named = set(re.findall(r"`(gpt_[\w.]+|t5_[\w.]+)`", README)) - {"gpt_from_pretrained", "t5_from_pretrained"}
    assert named and named <= set(packaged_configs()), named - set(packaged_configs())


SNIPPET = """
import lightning.pytorch as pl
from lightning_3d import Compressed3DStrategy
from lightning_3d.recipes import GPT
from lightning_3d.recipes.data import CausalLMDataModule

data = CausalLMDataModule(seq_length=64, batch_size=4, max_corpus_bytes=200000, cache_dir={cache!r})
model = GPT("tiny", vocab_size=data.vocab_size, seq_length=64)
trainer = pl.Trainer(accelerator="cpu", devices=2, max_steps=2, limit_val_batches=1, val_check_interval=2,
                     default_root_dir={runs!r},
                     strategy=Compressed3DStrategy(pipeline_parallel_size=2, num_microbatches=2))
trainer.fit(model, datamodule=data)
"""


def test_python_path_prints_what_the_cli_prints(tmp_path):
    """README "1. In Python" at tiny scale (CPU, pp = 2, a plain script): the model summary counts the whole model
    (not one stage), shows FLOPs per token, the bar reads "Epoch 0" without v_num, and none of Lightning's notices
    that say nothing (tensorboardX, "Tip", LeafSpec per rank) is printed: the strategy installs what the CLI does."""
    import os
    import subprocess

    import torch
    from lightning.pytorch.utilities.model_summary import get_human_readable_count

    from lightning_3d.recipes import GPT
    from lightning_3d.recipes.gpt import GPTModel
    from tests.conftest import RENDEZVOUS

    script = tmp_path / "train.py"
    script.write_text(SNIPPET.format(cache=str(tmp_path / "cache"), runs=str(tmp_path / "runs")))
    env = {k: v for k, v in os.environ.items() if k not in RENDEZVOUS}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", COLUMNS="160")
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, text=True, capture_output=True,
                          timeout=600)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    for noise in ("tensorboardX", "Tip:", "LeafSpec", "Epoch 0/", "v_num", "Total FLOPs"):
        assert noise not in out, (noise, out[-3000:])
    with torch.device("meta"):
        config = GPT("tiny", vocab_size=4096, seq_length=64).config
        whole = sum(p.numel() for p in GPTModel(config, config.padded_vocab_size(1)).parameters())
    assert re.search(rf"Total params\W+{re.escape(get_human_readable_count(whole))}\s", out), (whole, out[-3000:])
    assert re.search(r"Training FLOPs per token\W+\d", out) and re.search(r"Epoch 0 ", out), out[-3000:]


def _distribution(requirement: str) -> str:
    return re.split(r"[\[<>=!~ ;]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def test_declared_dependencies_are_what_the_package_imports():
    """Every third-party module the package imports (at any depth) is declared, and nothing else is."""
    from importlib import metadata

    import tomllib

    declared = {_distribution(r) for r in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]}
    modules = set()
    for path in (ROOT / "lightning_3d").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                modules |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                modules.add(node.module.split(".")[0])
    owners = metadata.packages_distributions()
    imported = {owners[m][0].lower().replace("_", "-") for m in modules - set(sys.stdlib_module_names) - {"lightning_3d"}}
    assert imported <= declared, imported - declared
    assert declared - imported == set(), declared - imported


def test_install_order_extras_and_notebook_list():
    """The CPU torch line (with its index URL) comes before the one-liner that would pull the CUDA build; the
    notebooks have an extra with Jupyter and widgets; the README links every notebook in notebooks/."""
    import tomllib

    bash = blocks("bash")
    cpu = next(i for i, b in enumerate(bash) if "pip install torch --index-url https://download.pytorch.org/whl/cpu" in b)
    one_liner = next(i for i, b in enumerate(bash) if "pip install -e . && lightning-3d fit --config gpt_tiny" in b)
    assert cpu < one_liner
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert {"jupyterlab", "ipykernel", "ipywidgets"} <= {_distribution(r) for r in extras["notebooks"]}
    assert 'pip install -e ".[notebooks]"' in README
    notebooks = sorted(p.name for p in (ROOT / "notebooks").glob("*.ipynb"))
    assert len(notebooks) == 5 and all(f"(notebooks/{name})" in README for name in notebooks), notebooks


def test_protocol_sketch_ties_the_head_again_after_parallelize_module():
    """parallelize_module gives each module a new Parameter: the sketch shows the re-tie the example needs."""
    sketch = blocks("python")[2]
    body = sketch[sketch.index("def parallelize_stage"):sketch.index("def pipeline_loss(")]
    assert "parallelize_module(" in body and "stage.head.weight = stage.embed.weight" in body, body
    example = (ROOT / "examples" / "own_model.py").read_text()
    assert "stage.head.weight = stage.embed.weight" in example
