"""PipelineTimeline: one training step's forward / backward / wait spans on every rank, as a Chrome trace and a PNG."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_3d.callbacks.plumbing import SpanRecorder, attach, detach, gather, output_dir, pipeline_runtime, require_compressed_3d

COLOURS = {"forward": "#4C72B0", "backward": "#DD8452", "weight": "#55A868", "wait": "#C44E52", "idle": "#D9D9D9"}


class PipelineTimeline(Callback):
    """Record training step ``step`` (the optimizer step, counted from 0) on every rank: the forward, backward and
    receive-wait spans of each (stage, micro-batch) and the idle gaps between them (sends, compression, bookkeeping).

    Rank 0 writes ``pipeline_timeline_step{step}.json`` (Chrome trace: open it in ``chrome://tracing`` or Perfetto;
    ``pid`` = pipeline rank, ``tid`` = stage, offset by 1000 per (dp, tp) replica; idle gaps on ``tid`` = …999) and
    ``pipeline_timeline_step{step}.png`` (one lane per rank) to ``output_dir`` (default: the trainer's log dir). Ranks
    are aligned by their wall clocks at the step's start. Costs nothing on the other steps.
    """

    def __init__(self, step: int = 5, output_dir: str | None = None) -> None:
        if step < 0:
            raise ValueError(f"PipelineTimeline(step={step}) must be >= 0.")
        self.step, self.output_dir = step, output_dir
        self.trace_path: Path | None = None
        self.plot_path: Path | None = None
        self._recorder: SpanRecorder | None = None
        self._runtime = self._strategy = self._dir = None

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._strategy = require_compressed_3d(self, trainer)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._dir = output_dir(trainer, self.output_dir)
        self._runtime = pipeline_runtime(self._strategy)
        if self._runtime is None:
            rank_zero_warn("PipelineTimeline: the module trains without a pipeline (no Parallel3DModule protocol);"
                           " there is no timeline to record.")
            return
        self._recorder = SpanRecorder(self._strategy.root_device)
        attach(self._runtime, self._recorder)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        if self._recorder is not None and self.trace_path is None and trainer.global_step == self.step:
            if not self._recorder.armed and not self._recorder.finished:
                self._recorder.arm()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self._recorder is None or not self._recorder.finished:
            return
        spans, duration = self._recorder.result()
        s = self._strategy
        mine = {"rank": trainer.global_rank, "pp": s.pp_rank, "dp": s.dp_rank, "tp": s.tp_rank, "tp_size": s.dims.tp,
                "wall": self._recorder.wall_start, "duration": duration, "spans": spans}
        rows = sorted(gather(mine), key=lambda r: (r["pp"], r["dp"], r["tp"]))
        self.trace_path = self._dir / f"pipeline_timeline_step{self.step}.json"
        self.plot_path = self.trace_path.with_suffix(".png")
        if trainer.is_global_zero:
            self._dir.mkdir(parents=True, exist_ok=True)
            self.trace_path.write_text(json.dumps(chrome_trace(rows)))
            plot_timeline(rows, self.plot_path, self.step)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._recorder is not None and self.trace_path is None:
            rank_zero_warn(f"PipelineTimeline: training step {self.step} never ran (max_steps or resume); no timeline.")
        self.teardown(trainer, pl_module, "fit")

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._recorder is not None and self._runtime is not None:
            detach(self._runtime, self._recorder)
        self._recorder = None


def idle_gaps(spans: list[tuple], duration: float) -> list[tuple[float, float]]:
    """The parts of [0, duration] that no span covers."""
    gaps, covered = [], 0.0
    for _, _, _, start, end in sorted(spans, key=lambda s: s[3]):
        if start > covered:
            gaps.append((covered, start))
        covered = max(covered, end)
    if duration > covered:
        gaps.append((covered, duration))
    return gaps


def chrome_trace(rows: list[dict]) -> dict:
    origin = min(r["wall"] for r in rows)
    events: list[dict] = []
    for r in rows:
        base, shift = 1000 * (r["dp"] * r["tp_size"] + r["tp"]), (r["wall"] - origin) * 1e6
        replica = f" (dp {r['dp']}, tp {r['tp']})" if base else ""
        events.append({"name": "process_name", "ph": "M", "pid": r["pp"], "args": {"name": f"pipeline rank {r['pp']}"}})
        spans = [(n, s, m, a, b) for n, s, m, a, b in r["spans"]]
        spans += [("idle", None, None, a, b) for a, b in idle_gaps(r["spans"], r["duration"])]
        for stage in sorted({s for _, s, *_ in spans if s is not None}) + [None]:
            tid = base + (999 if stage is None else stage)
            label = "idle" if stage is None else f"stage {stage}"
            events.append({"name": "thread_name", "ph": "M", "pid": r["pp"], "tid": tid, "args": {"name": label + replica}})
        for name, stage, mb, start, end in spans:
            args = {"rank": r["rank"], **({"microbatch": mb} if mb is not None else {})}
            events.append({"name": name, "cat": name, "ph": "X", "pid": r["pp"], "tid": base + (999 if stage is None else stage),
                           "ts": shift + start * 1e6, "dur": max(end - start, 0.0) * 1e6, "args": args})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def plot_timeline(rows: list[dict], path: Path, step: int) -> None:
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    origin = min(r["wall"] for r in rows)
    fig = Figure(figsize=(12, 0.6 * len(rows) + 1.5))
    ax = fig.subplots()
    for lane, r in enumerate(rows):
        shift = (r["wall"] - origin) * 1e3
        bars: dict[str, list] = {name: [] for name in COLOURS}
        for name, _, mb, start, end in r["spans"]:
            bars[name].append((shift + start * 1e3, (end - start) * 1e3))
            if name != "wait" and len(r["spans"]) <= 96:
                ax.text(shift + (start + end) * 5e2, lane, f"{name[0].upper()}{mb}", ha="center", va="center", fontsize=6)
        bars["idle"] = [(shift + a * 1e3, (b - a) * 1e3) for a, b in idle_gaps(r["spans"], r["duration"])]
        for name, ranges in bars.items():
            if ranges:
                ax.broken_barh(ranges, (lane - 0.4, 0.8), facecolors=COLOURS[name])
    ax.set_yticks(range(len(rows)), [f"pp{r['pp']} dp{r['dp']} tp{r['tp']}" for r in rows])
    ax.invert_yaxis()
    ax.set_xlabel("ms since the step began")
    ax.set_title(f"Pipeline timeline, training step {step}")
    ax.legend(handles=[Patch(color=c, label=n) for n, c in COLOURS.items()], loc="upper left", bbox_to_anchor=(1.0, 1.0),
              fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
