"""``lightning-3d fit|validate|test --config FILE``: Lightning's CLI with the GPT recipe and ``compressed_3d``
(any model, e.g. ``lightning_3d.recipes.T5``, by class path), and ``lightning-3d export`` to Hugging Face.

``--config`` takes a YAML path or the name of a config shipped in ``lightning_3d/recipes/configs``
(``lightning-3d fit --config gpt_tiny``). The model's ``vocab_size`` and ``seq_length`` (and a seq2seq model's
``pad_token_id`` / ``eos_token_id``) follow the data module (tokenizer) whenever both sides have them, so a config
never has to repeat them.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import inspect
import os
import re
import shlex
import sys
import warnings
from collections.abc import Sequence
from importlib import resources
from typing import NoReturn

import yaml
from jsonargparse import set_parsing_settings
from lightning.pytorch import Trainer
from lightning.pytorch.cli import ArgsType, LightningArgumentParser, LightningCLI

import lightning_3d  # noqa: F401  (registers the "compressed_3d" strategy name)
from lightning_3d.cli_checks import trainer_config_error, value_error
from lightning_3d.strategies.config import FLAT_OPTIONS, group_flat_options
from lightning_3d.strategies.run_output import quiet_lightning_notices, use_parallel_defaults

__all__ = ["build_cli", "main", "packaged_configs", "quiet_lightning_notices", "resolve_config"]

# The strategy's configs document each field by a docstring under it (strategies/config.py): show them in --help.
set_parsing_settings(docstring_parse_attribute_docstrings=True)

DEFAULT_MODEL = "lightning_3d.recipes.GPT"
DEFAULT_DATA = "lightning_3d.recipes.data.CausalLMDataModule"
CONFIG_OPTIONS = ("-c", "--config")
TRAINER_COMMANDS = ("fit", "validate", "test", "predict")


def top_help() -> str:
    """The epilog of ``lightning-3d --help``: the commands Lightning's parser does not know (export, plan, profile)."""
    return ("Also: `lightning-3d export --checkpoint DIR --output DIR` (a checkpoint as a Hugging Face transformers"
            " directory); `lightning-3d plan --config MODEL.yaml --gpus N --out plan.yaml` (search a layout);"
            " `lightning-3d profile --config MODEL.yaml` (measure each layer on this GPU). Each takes --help."
            f" Packaged configs for --config: {', '.join(packaged_configs())}.")


def command_help(command: str) -> str:
    """The description of ``lightning-3d <command> --help``: config names and where the strategy's options are."""
    return (f"Trainer.{command} with the GPT recipe on the offline corpus unless the config says otherwise. --config takes"
            f" a YAML path or a packaged config name: {', '.join(packaged_configs())} (e.g. `lightning-3d {command}"
            " --config gpt_tiny`). The strategy's options: `lightning-3d fit --trainer.strategy.help"
            " Compressed3DStrategy`.")


def packaged_configs() -> list[str]:
    """Names of the configs shipped with the package (``lightning-3d fit --config NAME``)."""
    folder = resources.files("lightning_3d.recipes").joinpath("configs")
    if not folder.is_dir():
        return []
    return sorted(entry.name[: -len(".yaml")] for entry in folder.iterdir() if entry.name.endswith(".yaml"))


def resolve_config(value: str) -> str:
    """A config path as given when it exists, else the packaged ``configs/<value>.yaml`` (``.yaml`` optional)."""
    if os.path.isfile(value) or value.lstrip().startswith(("{", "[")) or "\n" in value:
        return value  # a file, or jsonargparse's inline YAML/JSON
    name = value[: -len(".yaml")] if value.endswith(".yaml") else value
    if "/" not in name and os.sep not in name:
        candidate = resources.files("lightning_3d.recipes").joinpath("configs", f"{name}.yaml")
        if candidate.is_file():
            return str(candidate)
    available = ", ".join(packaged_configs()) or "(none)"
    raise FileNotFoundError(
        f"--config {value!r} is neither an existing file nor a config shipped with lightning_3d."
        f" Packaged configs: {available} (e.g. `lightning-3d fit --config gpt_tiny`)."
    )


def resolve_config_args(args: Sequence[str]) -> list[str]:
    """Rewrite every ``--config X`` / ``--config=X`` / ``-c X`` in ``args`` with :func:`resolve_config`, and the
    strategy's deprecated flat options (in those configs or on the command line) into their groups."""
    out = list(args)
    for i, arg in enumerate(out):
        if arg in CONFIG_OPTIONS and i + 1 < len(out):
            out[i + 1] = group_flat_config(resolve_config(out[i + 1]))
        elif arg.startswith("--config="):
            out[i] = "--config=" + group_flat_config(resolve_config(arg[len("--config=") :]))
    return group_flat_args(out)


# ----- the strategy's flat options of earlier releases (strategies/config.py) ---------------------------------------
_STRATEGY_ARG = re.compile(r"--trainer\.strategy\.(?:init_args\.)?(\w+)(=.*)?$", re.DOTALL)


def group_flat_config(config: str) -> str:
    """``config`` unchanged, or, when its ``trainer.strategy.init_args`` holds flat options, the same document as
    inline YAML with them moved into their groups (one FutureWarning names each move)."""
    if not os.path.isfile(config):
        return config
    with open(config, encoding="utf-8") as f:
        doc = yaml.safe_load(f)
    strategy = ((doc or {}).get("trainer") or {}).get("strategy") if isinstance(doc, dict) else None
    init = strategy.get("init_args") if isinstance(strategy, dict) else None
    if not isinstance(init, dict):
        return config
    flat = {k: v for k, v in init.items() if k in FLAT_OPTIONS or (k == "compression" and isinstance(v, bool))}
    if not flat:
        return config
    grouped = group_flat_options(flat, where=f"{config}: trainer.strategy.init_args", category=FutureWarning)
    rest = {k: v for k, v in init.items() if k not in flat}
    for group, values in grouped.items():
        rest[group] = {**(rest.get(group) or {}), **values}
    strategy["init_args"] = rest
    return yaml.safe_dump(doc, sort_keys=False)


def group_flat_args(args: Sequence[str]) -> list[str]:
    """``--trainer.strategy[.init_args].NAME[=V]`` for a flat option NAME becomes
    ``--trainer.strategy.init_args.GROUP.FIELD[=V]`` (``compression=<bool>``: ``compression.enabled``); one warning
    names every move."""
    out, flat = list(args), {}
    for i, arg in enumerate(out):
        match = _STRATEGY_ARG.match(arg)
        if not match:
            continue
        name, value = match.group(1), match.group(2)
        text = value[1:] if value is not None else (out[i + 1] if i + 1 < len(out) else "")
        if name == "compression":
            if text.strip().lower() not in ("true", "false"):
                continue  # the group itself (a dict or a config)
            flat[name] = text.strip().lower() == "true"
        elif name in FLAT_OPTIONS:
            flat[name] = text
        else:
            continue
        group, field = ("compression", "enabled") if name == "compression" else FLAT_OPTIONS[name]
        out[i] = f"--trainer.strategy.init_args.{group}.{field}" + (value or "")
    if flat:
        group_flat_options(flat, where="--trainer.strategy", category=FutureWarning)
    return out


# ----- short errors -------------------------------------------------------------------------------------------------
# jsonargparse reports a bad option or a class whose constructor refused its arguments as "Does not validate against any
# of the Union subtypes" with every subtype's error and the full value, after ~50 lines of usage. We print the one error
# that matters (the class's own message, or the unknown option with the closest accepted names) in a few lines.
_UNION = "Does not validate against any of the Union subtypes"


def _union_errors(message: str) -> list[str]:
    """The subtype errors of a jsonargparse union error, without the "Expected a <class ...>" of the subtypes that
    were never meant (``str`` for a strategy given as a class, ``None`` for a model)."""
    block = message.split("Errors:", 1)[-1].split("Given value type:", 1)[0]
    items, current = [], None
    for line in block.splitlines():
        stripped = line.strip()
        if stripped.startswith("- ") and (current is None or len(line) - len(line.lstrip()) <= current[0]):
            current = (len(line) - len(line.lstrip()), [stripped[2:]])
            items.append(current)
        elif current is not None and stripped:
            current[1].append(stripped)
    texts = [" ".join(lines) for _, lines in items]
    return [t for t in texts if not re.match(r"Expected a <class '[\w.]+'>$", t)] or texts


def _class_options(class_path: str) -> list[str]:
    """The constructor arguments of the class a config names (the CLI imports it anyway to build it)."""
    module, _, name = class_path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
        params = inspect.signature(cls.__init__).parameters.values()
    except (ImportError, AttributeError, TypeError, ValueError):
        return []
    names = []
    for p in params:
        if p.name == "self" or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        names.append(p.name)
        if dataclasses.is_dataclass(p.default):  # a grouped config (the strategy's): its fields as group.field
            names += [f"{p.name}.{f.name}" for f in dataclasses.fields(p.default)]
    return names


def did_you_mean(name: str, candidates: Sequence[str]) -> str:
    """``; did you mean 'x'?`` for the closest candidates of a misspelled option, else ``""``."""
    leaf = name.rsplit(".", 1)[-1]
    by_leaf = {c.rsplit(".", 1)[-1]: c for c in candidates}
    close = difflib.get_close_matches(name, candidates, n=2, cutoff=0.75) or [
        by_leaf[m] for m in difflib.get_close_matches(leaf, list(by_leaf), n=2, cutoff=0.75)]
    return f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""


def short_error(message: str, options: Sequence[str]) -> str:
    """The few lines of a jsonargparse error that say what is wrong, with a did-you-mean for misspelled options
    (``options``: the parser's option names)."""
    if _UNION in message:
        typed = value_error(message)
        if typed:
            return typed
        key = re.search(r'Parser key "([^"]+)"', message)
        given = re.search(r"class_path='([\w.]+)'", message.split("Given value:", 1)[-1])
        out = []
        for error in _union_errors(message):
            problem = re.match(r"Problem with given class_path '([\w.]+)': (.*)", error)
            unknown = re.search(r"Option '([\w.]+)' is not accepted", error)
            hint = did_you_mean(unknown.group(1), _class_options(problem.group(1))) if problem and unknown else ""
            if problem:
                out.append(f"{problem.group(1)}: {problem.group(2).rstrip('.')}{hint}")
            else:  # the class was built and raised: its own message
                out.append(f"{given.group(1)}: {error}" if given and not key else error)
        return (f"{key.group(1)}: " if key else "") + "\n".join(out)
    unknown = re.search(r"does not accept option '([\w.]+)'", message) or re.search(r"unrecognized arguments: --([\w.]+)", message)
    if unknown:
        return message.strip().rstrip(".") + did_you_mean(unknown.group(1), options)
    return message.strip()


class Lightning3DArgumentParser(LightningArgumentParser):
    """Lightning's parser printing :func:`short_error` and the ``--help`` hint instead of usage and jsonargparse's
    nested union reports."""

    def error(self, message: str, ex: Exception | None = None):
        if not self.exit_on_error or os.environ.get("JSONARGPARSE_DEBUG"):
            return super().error(message, ex)
        parser = getattr(ex, "subcommand_parser", None) or self
        options = [o.lstrip("-") for action in parser._actions for o in action.option_strings if o.startswith("--")]
        fail(parser.prog.replace(" [options]", ""), short_error(message, options))


def fail(prog: str, message: str) -> NoReturn:
    """Print ``message`` as the CLI's error and exit with argparse's code 2."""
    sys.stderr.write(f"{prog}: error: {message}\n(all options: {prog} --help)\n")
    sys.exit(2)


class Lightning3DCLI(LightningCLI):
    """LightningCLI whose model/data default to GPT on the offline corpus, any LightningModule allowed."""

    _given_args: list[str] = []  # the command line as typed (parse_arguments), for the commands printed after fit

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.set_defaults({"model": {"class_path": DEFAULT_MODEL}, "data": {"class_path": DEFAULT_DATA}})
        # The embedding must match the tokenizer: taken from the instantiated data module (the tokenizer may be
        # a local file whose size is only known once loaded). Links are skipped when either side lacks the name.
        parser.link_arguments("data.vocab_size", "model.init_args.vocab_size", apply_on="instantiate")
        # Seq2seq data (T5): the special ids the tokenizer layout gives (the GPT recipe has no such arguments).
        parser.link_arguments("data.pad_token_id", "model.init_args.pad_token_id", apply_on="instantiate")
        parser.link_arguments("data.eos_token_id", "model.init_args.eos_token_id", apply_on="instantiate")
        parser.link_arguments("data.init_args.seq_length", "model.init_args.seq_length", apply_on="parse")

    def instantiate_classes(self) -> None:
        config = self.config.get(self.subcommand) if self.subcommand else self.config
        problem = trainer_config_error(config.get("trainer") if config is not None else None)
        if problem:  # before the data module builds its corpus and Lightning or torch raise their own errors
            fail(" ".join(filter(None, (self.parser.prog, self.subcommand))), problem)
        try:
            super().instantiate_classes()
        except ValueError as err:  # a class refused its arguments (the strategy's checks): its message, shortly
            if _UNION not in str(err):
                raise
            fail(" ".join(filter(None, (self.parser.prog, self.subcommand))), short_error(str(err), []))

    def instantiate_trainer(self, **kwargs) -> Trainer:
        """Lightning's trainer, with its default model summary and rich progress bar replaced by ours (whole-model
        parameter counts under pipeline/tensor parallelism, no "Epoch 0/-2"); user-configured ones are kept."""
        trainer = super().instantiate_trainer(**kwargs)
        use_parallel_defaults(trainer)  # any strategy; Compressed3DStrategy does it again in setup (idempotent)
        return trainer

    def after_fit(self) -> None:
        """Say where the checkpoint is and what to do with it (rank 0): the fit's own arguments, to validate."""
        callback = self.trainer.checkpoint_callback
        path = (callback.best_model_path or callback.last_model_path) if callback is not None else ""
        if path and self.trainer.is_global_zero:
            print(f"checkpoint: {path}\n  lightning-3d validate {validate_arguments(self._given_args, path)}"
                  f"\n  lightning-3d export --checkpoint {shlex.quote(path)} --output <hf directory>")

    def before_validate(self) -> None:
        # A checkpoint's ModelCheckpoint state names the fit's log version; validate writes no checkpoint, so
        # Lightning's "dirpath has changed" (its best/last paths are not restored) says nothing here.
        warnings.filterwarnings("ignore", message=r"The dirpath has changed from")

    before_test = before_validate

    def parse_arguments(self, parser: LightningArgumentParser, args: ArgsType) -> None:
        if args is not None and not isinstance(args, (list, tuple)):
            return super().parse_arguments(parser, args)  # a dict or Namespace: nothing to resolve
        given = args is not None
        self._given_args = list(args if given else sys.argv[1:])  # as typed: packaged config names unresolved
        try:
            args = resolve_config_args(args if given else sys.argv[1:])
        except FileNotFoundError as err:
            parser.error(str(err))
        if given:
            return super().parse_arguments(parser, args)
        self.config = parser.parse_args(args)  # the (rewritten) command line, without the args-vs-argv warning


def validate_arguments(fit_args: Sequence[str], checkpoint: str) -> str:
    """The ``validate`` arguments after a fit run with ``fit_args``: the same configs and options (data and model
    shapes must match the checkpoint), the fit-only ``--ckpt_path`` replaced by ``checkpoint``."""
    args, skip = [], False
    for i, arg in enumerate(fit_args):
        if skip or (i == 0 and arg == "fit"):
            skip = False
            continue
        if arg == "--ckpt_path":
            skip = True
        elif not arg.startswith("--ckpt_path="):
            args.append(arg)
    return shlex.join([*args, "--ckpt_path", checkpoint])


def build_cli(args: ArgsType = None, run: bool = True) -> Lightning3DCLI:
    """The CLI object (runs the subcommand when ``run``); ``args`` replaces ``sys.argv[1:]``, e.g. in tests."""
    return Lightning3DCLI(
        model_class=None,
        parser_class=Lightning3DArgumentParser,
        datamodule_class=None,
        subclass_mode_model=True,
        subclass_mode_data=True,
        # Every rank builds the CLI; only rank 0 writes config.yaml, and reruns into the same log dir must not fail.
        save_config_kwargs={"overwrite": True},
        parser_kwargs={"epilog": top_help(), **{c: {"description": command_help(c),
                                                    "usage": f"lightning-3d {c} [--config CONFIG] [--KEY VALUE ...]"}
                                                for c in TRAINER_COMMANDS}},
        args=args,
        run=run,
    )


def export_main(argv: list[str]) -> None:
    """``lightning-3d export``: prints where the model and the tokenizer were written."""
    import argparse

    from lightning_3d.recipes.export import export_checkpoint

    parser = argparse.ArgumentParser(prog="lightning-3d export", description="GPT or T5 checkpoint -> Hugging Face"
                                     " directory (GPT2LMHeadModel or T5ForConditionalGeneration, by the checkpoint's model)")
    parser.add_argument("--checkpoint", required=True, help="checkpoint directory (trainer.save_checkpoint)")
    parser.add_argument("--output", required=True, help="directory for save_pretrained")
    parser.add_argument("--tokenizer", default=None, help="tokenizer.json, tokenizer directory or 'bytes' (default: the"
                        " tokenizer stored in the checkpoint by the recipes' data modules)")
    ns = parser.parse_args(argv)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a one-file "Writing model shards" bar says nothing
    try:
        out = export_checkpoint(ns.checkpoint, ns.output, tokenizer=ns.tokenizer)
    except (FileNotFoundError, ValueError) as err:
        parser.error(str(err))  # a one-line message and exit code 2, not a traceback
    files = [out / n for n in ("tokenizer.json", "tokenizer_config.json") if (out / n).is_file()]
    if files:
        source = f"from {ns.tokenizer}" if ns.tokenizer else "stored in the checkpoint"
        print(f"tokenizer: {files[0]} ({source})")
    else:
        print("tokenizer: none (the checkpoint stores none; pass --tokenizer PATH to include one)")
    print(f"exported to {out}")  # last: scripts take the directory from the end of the output


def main(args: ArgsType = None) -> None:
    """Entry point of the ``lightning-3d`` console script (returns nothing: its result becomes the exit code)."""
    argv = list(args) if isinstance(args, (list, tuple)) else sys.argv[1:] if args is None else None
    if argv and argv[0] in ("profile", "plan"):  # `lightning-3d profile|plan ...` (docs/planner.md)
        import lightning_3d.recipes  # noqa: F401  (registers the GPT and T5 recipes with the planner)
        from lightning_3d.planner import plan_main, profile_main

        code = (profile_main if argv[0] == "profile" else plan_main)(argv[1:])
        if code:  # `plan --verify` where no candidate ran
            raise SystemExit(code)
        return
    if argv and argv[0] == "export":  # `lightning-3d export --checkpoint DIR --output DIR [--tokenizer PATH]`
        return export_main(argv[1:])
    quiet_lightning_notices()
    build_cli(args)


if __name__ == "__main__":
    main()
