"""SC: PowerSGD compression of data-parallel gradients, on the pipeline stages chosen for it.

This drives PyTorch's own ``powerSGD_hook`` (rank, warm-up of plain all-reduce, error feedback, warm
start, 1-D tensors sent exactly) from our gradient synchroniser. The hook expects DDP's ``GradBucket``,
which cannot be constructed from Python; it only calls ``buffer()``, ``index()``, ``gradients()`` and
``is_last()``, which ``HookBucket`` provides over our flat bucket.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, powerSGD_hook

from lightning_3d.compression.stats import CommunicationStats

# torch's PowerSGDState refuses fewer than 2 plain steps when error feedback or warm start is on.
MIN_WARMUP_STEPS = 2


class HookBucket:
    """The part of ``torch.distributed.GradBucket`` that ``powerSGD_hook`` uses."""

    def __init__(self, index: int, flat: Tensor, shapes: Sequence[torch.Size], is_last: bool) -> None:
        self._index, self._flat, self._is_last = index, flat, is_last
        self._views, offset = [], 0
        for shape in shapes:
            n = shape.numel()
            self._views.append(flat[offset : offset + n].view(shape))
            offset += n

    def buffer(self) -> Tensor:
        return self._flat

    def index(self) -> int:
        return self._index

    def gradients(self) -> list[Tensor]:
        return self._views

    def is_last(self) -> bool:
        return self._is_last


class DataParallelPowerSGD:
    """Averages a bucket over the data-parallel group through PowerSGD; returns a future of the result."""

    def __init__(
        self,
        dp_group: dist.ProcessGroup,
        rank: int = 128,
        warmup_steps: int = 100,
        min_compression_rate: float = 2.0,
        seed: int = 0,
        stats: CommunicationStats | None = None,
    ) -> None:
        self.warmup_steps = max(MIN_WARMUP_STEPS, warmup_steps)
        self.state = PowerSGDState(
            process_group=dp_group,
            matrix_approximation_rank=rank,
            start_powerSGD_iter=self.warmup_steps,
            min_compression_rate=min_compression_rate,
            use_error_feedback=True,
            warm_start=True,
            random_seed=seed,
            compression_stats_logging_frequency=1 << 62,
        )
        self.stats = stats
        # Diagnostics: ``observe_step(step) -> bool`` picks steps; ``observer(bucket, exact, compressed)`` then
        # gets the exact average (one extra plain all-reduce on those steps only) and PowerSGD's result.
        self.observe_step: Callable[[int], bool] | None = None
        self.observer: Callable[[int, Tensor, Tensor], None] | None = None
        self._exact: dict[int, Tensor] = {}

    def launch(self, index: int, flat: Tensor, shapes: Sequence[torch.Size], is_last: bool) -> torch.futures.Future:
        before = self.state.total_numel_before_compression
        after = self.state.total_numel_after_compression
        compressing = self.state.iter >= self.state.start_powerSGD_iter
        if compressing and self.observer is not None and self.observe_step is not None and self.observe_step(self.state.iter):
            exact = flat.clone()
            dist.all_reduce(exact, group=self.state.process_group)
            self._exact[index] = exact.div_(dist.get_world_size(self.state.process_group))
        future = powerSGD_hook(self.state, HookBucket(index, flat, shapes, is_last))
        if self.stats is not None:
            size = flat.element_size()
            if compressing:  # the hook counted the elements it sends, compressed or not
                self.stats.add("dp_gradients", (self.state.total_numel_before_compression - before) * size,
                               (self.state.total_numel_after_compression - after) * size)
            else:
                self.stats.add("dp_gradients", flat.numel() * size)
        return future

    def finished(self, index: int, result: Tensor) -> None:
        """Called with a bucket's averaged result once it is complete (hands it to the observer if sampled)."""
        exact = self._exact.pop(index, None)
        if exact is not None and self.observer is not None:
            self.observer(index, exact, result)

    @property
    def compressing(self) -> bool:
        return self.state.iter >= self.state.start_powerSGD_iter

    def state_dict(self) -> dict:
        s = self.state
        return {"iter": s.iter, "error_dict": dict(s.error_dict), "p_memory_dict": dict(s.p_memory_dict),
                "q_memory_dict": dict(s.q_memory_dict), "rng_state": s.rng.get_state()}

    def load_state_dict(self, state: dict) -> None:
        s = self.state
        s.iter = state["iter"]
        s.error_dict, s.p_memory_dict, s.q_memory_dict = (dict(state[k]) for k in ("error_dict", "p_memory_dict", "q_memory_dict"))
        s.rng.set_state(state["rng_state"])
