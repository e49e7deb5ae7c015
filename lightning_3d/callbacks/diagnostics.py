"""CompressionDiagnostics: the Optimus-CC orthogonality check and the fidelity of every compressed message."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor

from lightning_3d.callbacks.plumbing import (
    RuntimeListener,
    attach,
    detach,
    gather,
    log_rank_zero,
    output_dir,
    pipeline_runtime,
    require_compressed_3d,
)
from lightning_3d.pipeline.codec import BoundaryKey


def cosine(a: Tensor, b: Tensor) -> Tensor:
    """cos(a, b) of the flattened tensors in fp32, 0 when either is zero (a 0-d tensor: no host synchronisation)."""
    a, b = a.reshape(-1).float(), b.reshape(-1).float()
    return (a @ b) / (a.norm() * b.norm()).clamp_min(1e-30)


def relative_error(approx: Tensor, exact: Tensor) -> Tensor:
    """‖approx − exact‖ / ‖exact‖ (fp32, 0-d)."""
    exact = exact.reshape(-1).float()
    return (approx.reshape(-1).float() - exact).norm() / exact.norm().clamp_min(1e-30)


class DiagnosticsRecorder(RuntimeListener):
    """What one rank measures on a sampled step; the ``CodecObserver`` of ``CompressedBackprop``, a runtime
    listener (received activations) and the selective compression observer in one. Usable on its own.

    ``tp_size``/``tp_rank``: the codec's split of the sequence over tensor ranks (``CompressedBackprop`` compresses
    only this rank's 1/tp of dim 1 when it divides; the activations are cut the same way before comparing).
    """

    def __init__(self, tp_size: int = 1, tp_rank: int = 0, sc_prefix: str = "diag/sc") -> None:
        self.tp_size, self.tp_rank, self.sc_prefix = tp_size, tp_rank, sc_prefix
        self.sampling = False
        self._reset()

    def _reset(self) -> None:
        self._acts: dict[tuple[int, int], Tensor] = {}
        self._errors: dict[tuple[int, int], Tensor] = {}
        self._paired: set[tuple[int, int]] = set()
        self._pairs: dict[int, list[Tensor]] = {}
        self._cb: dict[int, list[tuple[Tensor, Tensor]]] = {}
        self._sc: dict[int, tuple[Tensor, Tensor]] = {}

    def begin_step(self) -> None:
        self._reset()
        self.sampling = True

    def end_step(self) -> dict[str, float]:
        """The step's metrics: means over micro-batch pairs / micro-batches, per boundary and per SC bucket."""
        self.sampling = False
        names, values = [], []
        for stage, cos in sorted(self._pairs.items()):
            cos = torch.stack(cos)
            names += [f"diag/cb/stage{stage}/cos_error_vs_act_diff", f"diag/cb/stage{stage}/abs_cos_error_vs_act_diff"]
            values += [cos.mean(), cos.abs().mean()]
        for stage, pairs in sorted(self._cb.items()):
            cos, rel = (torch.stack(v) for v in zip(*pairs, strict=True))
            names += [f"diag/cb/stage{stage}/cos_rebuilt_vs_grad", f"diag/cb/stage{stage}/rel_error"]
            values += [cos.mean(), rel.mean()]
        for bucket, (cos, rel) in sorted(self._sc.items()):
            names += [f"{self.sc_prefix}/bucket{bucket}/cos", f"{self.sc_prefix}/bucket{bucket}/rel_error"]
            values += [cos, rel]
        self._reset()
        if not values:
            return {}
        device = values[0].device  # one host synchronisation for the whole step
        return dict(zip(names, torch.stack([v.float().to(device) for v in values]).tolist(), strict=True))

    # ----- CodecObserver (sender side of compressed backpropagation) ---------------------------------------------
    def wants(self, key: BoundaryKey) -> bool:
        return self.sampling

    def __call__(self, key: BoundaryKey, tensors: dict[str, Tensor]) -> None:
        grad, rebuilt = tensors["grad"], tensors["rebuilt"]
        self._cb.setdefault(key.stage, []).append((cosine(rebuilt, grad), relative_error(rebuilt, grad)))
        error = tensors.get("error_out")
        slot = (key.stage, key.microbatch)
        if error is not None and key.tensor == 0 and slot not in self._paired:  # the boundary's first tensor
            self._errors[slot] = error
            self._pair(key.stage, key.microbatch)

    # ----- RuntimeListener: the activations a stage received (their gradients are what it sends back) -------------
    def on_received(self, stage: int, microbatch: int, tensors: list[Tensor]) -> None:
        if not self.sampling:
            return
        act = next((t for t in tensors if t.is_floating_point()), None)
        if act is None:
            return
        if self.tp_size > 1 and act.dim() >= 3 and act.shape[1] % self.tp_size == 0:
            act = act.chunk(self.tp_size, dim=1)[self.tp_rank]  # the piece CompressedBackprop.piece_shape cuts
        self._acts[(stage, microbatch)] = act.detach()
        self._pair(stage, microbatch - 1)
        self._pair(stage, microbatch)

    def _pair(self, stage: int, i: int) -> None:
        """cos(e_i, a_i − a_{i+1}) once all three are known; then drop what no pair needs any more."""
        e, a, b = self._errors.get((stage, i)), self._acts.get((stage, i)), self._acts.get((stage, i + 1))
        if e is None or a is None or b is None:
            return
        del self._errors[(stage, i)]
        self._paired.add((stage, i))
        if a.shape == b.shape and a.numel() == e.numel():  # micro-batches of different shapes do not pair
            self._pairs.setdefault(stage, []).append(cosine(e, a.float() - b.float()))
        for j in (i, i + 1):
            if (j == 0 or (stage, j - 1) in self._paired) and (stage, j) in self._paired:
                self._acts.pop((stage, j), None)

    # ----- selective compression observer ---------------------------------------------------------------------
    def sc_wanted(self, step: int) -> bool:
        return self.sampling

    def sc_observer(self, bucket: int, exact: Tensor, compressed: Tensor) -> None:
        self._sc[bucket] = (cosine(compressed, exact), relative_error(compressed, exact))


class CompressionDiagnostics(Callback):
    """Every ``every_n_steps`` optimizer steps (``trainer.global_step % every_n_steps == 0``, the same steps on all
    ranks), measure on every rank that sends compressed activation gradients:

    - ``diag/cb/stage{s}/cos_error_vs_act_diff`` and ``abs_cos_error_vs_act_diff``: the mean cosine (and mean
      absolute cosine) between the LEP error e_i kept after micro-batch i and the difference a_i − a_{i+1} of the
      activations stage s received for consecutive micro-batches: Optimus-CC's orthogonality check;
    - ``diag/cb/stage{s}/cos_rebuilt_vs_grad`` and ``rel_error``: cos(P·Qᵀ, gradient) and ‖P·Qᵀ − g‖ / ‖g‖ per send;
    - ``diag/sc/pp{p}[/tp{t}]/bucket{b}/cos`` and ``rel_error``: PowerSGD's average of a data-parallel bucket
      against the exact average (one extra plain all-reduce per bucket on sampled steps, after SC's warm-up).

    Ranks' values are gathered (one small all-gather per sampled step), averaged over the ranks holding the same
    boundary or bucket and logged by rank 0 to the trainer's loggers at the sampled step. With ``plot`` rank 0 writes
    ``compression_diagnostics.png`` (the series over steps) to the trainer's log dir at the end of fit. Unsampled
    steps cost one attribute check per compressed send.
    """

    def __init__(self, every_n_steps: int = 50, plot: bool = True) -> None:
        if every_n_steps < 1:
            raise ValueError(f"CompressionDiagnostics(every_n_steps={every_n_steps}) must be >= 1.")
        self.every_n_steps, self.plot = every_n_steps, plot
        self.history: dict[str, list[tuple[int, float]]] = {}  # rank 0: metric -> [(step, value)]
        self.plot_path: Path | None = None
        self.recorder: DiagnosticsRecorder | None = None
        self._strategy = self._runtime = self._dir = None
        self._step = 0

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._strategy = require_compressed_3d(self, trainer)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        s = self._strategy
        codec, sc = s.compressed_backprop, s.selective_compression
        if codec is None and not s.compresses_data_parallel_anywhere:
            rank_zero_warn("CompressionDiagnostics: compression is off for this run (compression=False, no pipeline"
                           " and data parallelism to compress, or SC left off on a data-parallel link faster than"
                           " sc_max_link_gbps), so there is nothing to diagnose.")
            return
        if codec is not None and not codec.config.lazy_error_propagation:
            rank_zero_warn("CompressionDiagnostics: cos(e_i, a_i - a_(i+1)) needs LEP errors and LEP is off"
                           " (cb_lazy_error_propagation=False, the default); the other diagnostics are logged.")
        if self.plot:
            self._dir = output_dir(trainer, None)
        prefix = f"diag/sc/pp{s.pp_rank}" + (f"/tp{s.tp_rank}" if s.dims.tp > 1 else "")
        self.recorder = DiagnosticsRecorder(codec.tp_size if codec else 1, codec.tp_rank if codec else 0, prefix)
        self._runtime = pipeline_runtime(s)
        if codec is not None:
            codec.observer = self.recorder
            attach(self._runtime, self.recorder)
        if sc is not None:
            sc.observer, sc.observe_step = self.recorder.sc_observer, self.recorder.sc_wanted

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        # Sample the batch whose gradients are synchronised (the last of an accumulation window): same on all ranks.
        last = (batch_idx + 1) % trainer.accumulate_grad_batches == 0
        if self.recorder is not None and last and trainer.global_step % self.every_n_steps == 0:
            self._step = trainer.global_step
            self.recorder.begin_step()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.recorder is None or not self.recorder.sampling:
            return
        merged: dict[str, list[float]] = {}
        for metrics in gather(self.recorder.end_step()):
            for name, value in metrics.items():
                merged.setdefault(name, []).append(value)
        means = {name: sum(v) / len(v) for name, v in merged.items()}
        if trainer.is_global_zero:
            for name, value in means.items():
                self.history.setdefault(name, []).append((self._step, value))
            log_rank_zero(trainer, means, self._step)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.plot and self.history and trainer.is_global_zero and self._dir is not None:
            self._dir.mkdir(parents=True, exist_ok=True)
            self.plot_path = self._dir / "compression_diagnostics.png"
            plot_diagnostics(self.history, self.plot_path)
        self.teardown(trainer, pl_module, "fit")

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self.recorder is None:
            return
        codec, sc = self._strategy.compressed_backprop, self._strategy.selective_compression
        if codec is not None and codec.observer is self.recorder:
            codec.observer = None
            detach(self._runtime, self.recorder)
        if sc is not None and sc.observer == self.recorder.sc_observer:
            sc.observer = sc.observe_step = None
        self.recorder = None


PANELS = (("cos_error_vs_act_diff", "LEP error vs a_i − a_(i+1): cos (solid), |cos| (dashed)"),
          ("cos_rebuilt_vs_grad", "CB: cos(P·Qᵀ, gradient)"), ("rel_error", "relative error ‖approx − exact‖/‖exact‖"),
          ("/cos", "SC: cos(PowerSGD average, exact average)"))


def plot_diagnostics(history: dict[str, list[tuple[int, float]]], path: Path) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(12, 8))
    for ax, (suffix, title) in zip(fig.subplots(2, 2).flat, PANELS, strict=True):
        shown = 0
        for name, series in sorted(history.items()):
            if not name.endswith(suffix) or "/abs_" in name or (suffix == "/cos" and not name.startswith("diag/sc/")):
                continue
            label = name.removeprefix("diag/").rsplit("/", 1)[0]
            steps, values = zip(*series, strict=True)
            line = ax.plot(steps, values, marker="o", markersize=3, label=label if shown < 12 else None)[0]
            abs_series = history.get(name.replace("/cos_error", "/abs_cos_error"))
            if suffix == "cos_error_vs_act_diff" and abs_series:
                ax.plot(*zip(*abs_series, strict=True), linestyle="--", color=line.get_color())
            shown += 1
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        if shown:
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
