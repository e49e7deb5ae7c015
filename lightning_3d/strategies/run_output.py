"""What a run prints, made true under 3D parallelism, for the Python path as for ``lightning-3d``.

:class:`ParallelModelSummary` counts the whole model (all pipeline stages and tensor shards, a tied head once, not
rank 0's part) and shows the training FLOPs per token; :class:`StepProgressBar` reads "Epoch N" (not "Epoch 0/-2",
nor "v_num") when training is bounded by steps. :func:`use_parallel_defaults` switches a Trainer's *default* model
summary and rich progress bar to these (as Lightning's own strategies adjust defaults); a user's own callbacks of
other classes are kept. :func:`quiet_lightning_notices` silences Lightning's notices that say nothing about the run.
``Compressed3DStrategy`` calls both (README, "What a run prints"); ``lightning_3d.callbacks`` re-exports the classes.

This module sits in the strategies layer (the strategy installs it), so it reads the strategy by duck typing
(``dims``, ``dp_rank``, ``tp_rank``) instead of importing it.
"""

from __future__ import annotations

import inspect
import logging
import re
import warnings
from typing import Any

import lightning.pytorch as pl
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelSummary, RichModelSummary, RichProgressBar
from lightning.pytorch.utilities.model_summary import get_formatted_model_size, get_human_readable_count
from lightning.pytorch.utilities.rank_zero import rank_zero_info

# Warnings that every run printed and that say nothing about it: that the CSV logger is used when tensorboard is not
# installed (Lightning's documented default: metrics.csv in the log directory), a deprecation inside Lightning's own
# pytree helper (nothing a user can change; once per rank), and the empty validation loader list the recipes' data
# modules return for ``val_fraction=0`` (no validation is what was asked for).
_NOTICES = (r"Starting from v1\.9\.0, `tensorboardX` has been removed", r"`isinstance\(treespec, LeafSpec\)` is deprecated",
            r"Total length of `list` across ranks is zero")
# Log lines: Lightning's advertisements ("Tip") and the distributed banner of a one-process run (no process group
# worth announcing: the strategy creates one even then, for its collectives' uniform code path).
_LOG_NOTICES = re.compile("\N{ELECTRIC LIGHT BULB} Tip:|Initializing distributed: GLOBAL_RANK: 0, MEMBER: 1/1$"
                          "|-+\ndistributed_backend=\\w+\nAll distributed processes registered. Starting with 1 processes\n")
_LOGGERS = ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.distributed")


def _not_a_notice(record: logging.LogRecord) -> bool:
    return not _LOG_NOTICES.match(str(record.msg))


def quiet_lightning_notices() -> None:
    """Silence the notices above in this process (idempotent). The strategy calls it when a Trainer takes it, on
    every rank; ``lightning-3d`` calls it first thing."""
    for pattern in _NOTICES:
        warnings.filterwarnings("ignore", message=pattern)
    for name in _LOGGERS:
        log = logging.getLogger(name)
        if _not_a_notice not in log.filters:
            log.addFilter(_not_a_notice)


def use_parallel_defaults(trainer: pl.Trainer) -> None:
    """Switch the trainer's Lightning-default model summary and rich progress bar (exactly those classes) to
    :class:`ParallelModelSummary` / :class:`StepProgressBar`. Same attributes, other methods: switching the class
    keeps the options they were built with (``max_depth``, the theme); subclasses a user chose are left alone."""
    for callback in trainer.callbacks:
        if type(callback) in (ModelSummary, RichModelSummary):
            callback.__class__ = ParallelModelSummary
        elif type(callback) is RichProgressBar:
            callback.__class__ = StepProgressBar


def _gather(obj: Any) -> list[Any]:
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def stage_parameter_counts(pl_module: pl.LightningModule) -> dict[str, tuple[int, int]]:
    """``{top-level child name: (parameters, trainable)}`` of the parameters this rank holds, each counted at its
    full size (a DTensor's ``numel`` is the global one). A tied copy whose partner lives on another pipeline stage
    (``pipeline_tied_parameters``: the last stage's head tied to the first stage's embedding) is left out: the model
    has it once."""
    params = dict(pl_module.named_parameters())
    tied = getattr(pl_module, "pipeline_tied_parameters", dict)() or {}
    copies = {last for first, last in tied.items() if last in params and first not in params}
    counts: dict[str, tuple[int, int]] = {}
    for name, p in params.items():
        if name in copies:
            continue
        row = name.split(".", 1)[0]
        total, trainable = counts.get(row, (0, 0))
        counts[row] = (total + p.numel(), trainable + (p.numel() if p.requires_grad else 0))
    return counts


def whole_model_counts(trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, tuple[int, int]]:
    """:func:`stage_parameter_counts` summed over the pipeline stages of one model replica (the ranks with dp and tp
    coordinate 0). A collective under ``Compressed3DStrategy``: every rank calls it."""
    mine = stage_parameter_counts(pl_module)
    strategy = trainer.strategy
    dims = getattr(strategy, "dims", None)
    if dims is None or not hasattr(strategy, "tp_rank") or dims.world_size == 1:
        return mine
    counted = strategy.dp_rank == 0 and strategy.tp_rank == 0
    out: dict[str, tuple[int, int]] = {}
    for part in _gather(mine if counted else {}):
        for row, (total, trainable) in part.items():
            t, tr = out.get(row, (0, 0))
            out[row] = (t + total, tr + trainable)
    return out


def model_flops_per_token(trainer: pl.Trainer, pl_module: pl.LightningModule) -> float | None:
    """``pl_module.flops_per_token(...)``, its required arguments read from the data module by name (T5's
    ``input_length`` and ``target_length``: FLOPs per input + target token depend on both); None when the module
    has no such method or the data module lacks an argument."""
    method = getattr(pl_module, "flops_per_token", None)
    if not callable(method):
        return None
    kwargs, data = {}, getattr(trainer, "datamodule", None)
    for p in inspect.signature(method).parameters.values():
        if p.default is not p.empty or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        value = getattr(data, p.name, None)
        if not isinstance(value, int):
            return None
        kwargs[p.name] = value
    return method(**kwargs)


class ParallelModelSummary(ModelSummary):
    """Lightning's model summary with the whole model's parameter counts (summed over pipeline stages, tensor-parallel
    parameters at full size) and, instead of Lightning's "Total FLOPs" (0 without an ``example_input_array``), the
    module's training FLOPs per token when it defines ``flops_per_token()`` (the recipes do; T5's at the data module's
    input and target lengths). Printed on rank 0."""

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._counts = whole_model_counts(trainer, pl_module)
        self._local = sum(total for total, _ in stage_parameter_counts(pl_module).values())
        self._flops_per_token = model_flops_per_token(trainer, pl_module)
        super().on_fit_start(trainer, pl_module)

    def summarize(self, summary_data: list[tuple[str, list[str]]], total_parameters: int, trainable_parameters: int,
                  model_size: float, total_training_modes: dict[str, int], total_flops: int, **kwargs: Any) -> None:
        counts = getattr(self, "_counts", {})
        columns = dict(summary_data)
        names, params = columns.get("Name", []), columns.get("Params")
        if params is not None:
            columns["Params"] = [get_human_readable_count(counts[n][0]) if n in counts else p for n, p in zip(names, params)]
        columns.pop("FLOPs", None)
        whole = sum(t for t, _ in counts.values()) or total_parameters
        trainable = sum(tr for _, tr in counts.values()) if counts else trainable_parameters
        size = model_size * whole / max(getattr(self, "_local", 0) or total_parameters, 1)
        lines = [("Trainable params", get_human_readable_count(trainable)),
                 ("Non-trainable params", get_human_readable_count(whole - trainable)),
                 ("Total params", get_human_readable_count(whole)),
                 ("Total estimated model params size (MB)", get_formatted_model_size(size)),
                 ("Modules in train mode (this rank)", str(total_training_modes["train"])),
                 ("Modules in eval mode (this rank)", str(total_training_modes["eval"]))]
        if getattr(self, "_flops_per_token", None):
            lines.append(("Training FLOPs per token", get_human_readable_count(int(self._flops_per_token))))
        _print_summary(columns, lines)


def _print_summary(columns: dict[str, list[str]], lines: list[tuple[str, str]]) -> None:
    try:
        from rich import get_console
        from rich.table import Table
    except ImportError:  # Lightning without rich: plain text
        header = " | ".join(columns)
        rows = [" | ".join(row) for row in zip(*columns.values())]
        rank_zero_info("\n".join([header, *rows, *(f"{k}: {v}" for k, v in lines)]))
        return
    table = Table(header_style="bold magenta")
    for name in columns:
        table.add_column(name, justify="right" if name == "Params" else "left", no_wrap=name == "Name")
    for row in zip(*columns.values()):
        table.add_row(*row)
    console = get_console()
    console.print(table)
    grid = Table.grid(expand=True)
    grid.add_column()
    for key, value in lines:
        grid.add_row(f"[bold]{key}[/]: {value}")
    console.print(grid)


class StepProgressBar(RichProgressBar):
    """Lightning's rich progress bar reading "Epoch N" (not "Epoch N/-2") when ``max_epochs`` is unbounded (training
    bounded by ``max_steps``), without the logger version ("v_num: 0.000")."""

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_epoch_start(trainer, pl_module)
        if trainer.max_epochs in (None, -1) and self.progress is not None and self.train_progress_bar_id is not None:
            description = f"Epoch {trainer.current_epoch}"
            if self.theme.description:
                description = f"[{self.theme.description}]{description}"
            self.progress.update(self.train_progress_bar_id, description=description)
            self.refresh()

    def get_metrics(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
        items = super().get_metrics(trainer, pl_module)
        items.pop("v_num", None)
        return items
