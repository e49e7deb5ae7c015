"""SC: PowerSGD compression of data-parallel gradients, on the pipeline stages chosen for it.

The algorithm and its state are those of PyTorch's ``powerSGD_hook`` with ``batch_tensors_with_same_shape=True``:
rank r, plain all-reduce during a warm-up, error feedback, Q warm-started from the previous step, and every tensor
whose factors would not be ``min_compression_rate`` times smaller (1-D tensors among them) sent exactly. Results
equal the hook's up to rounding (``tests/test_compression.py`` runs both side by side).

It is written here rather than called because the hook is slow on GPUs (``benchmarks/compression/sc_kernels.py`` compares the
two; the numbers: benchmarks/RESULTS.md#2026-11-22d-sc-kernels):
- the gradient synchronizer hands a compressed stage over as one bucket with same-shape matrices side by side, so
  each shape is one batch (six for a GPT stage) computed in place on views of the bucket and of its error buffer,
  instead of one small batch per shape per bucket (thousands of kernel launches per step for a GPT stage);
- P and Q are orthonormalised by a shifted Cholesky-QR (``lowrank.orthonormalize``), a few batched kernels, instead
  of Householder QR in cuSOLVER (latency-bound, two calls per shape per bucket);
- the hook calls ``torch.cuda.synchronize()`` once per bucket; here nothing waits on the host;
- it chains its three collectives through future callbacks, which gloo runs on its own threads (the order of
  collectives across buckets then differs between ranks); here they are issued in order by the caller.
Factors are stored and summed in fp32 whatever the gradient dtype; the bulk products run on TF32 tensor cores unless
``matmul_precision='fp32'`` (see ``MATMUL_PRECISIONS``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from lightning_3d.compression.lowrank import fp32_matmul_precision, orthonormalize
from lightning_3d.utils.comm_stats import CommunicationStats

# The power step's three bulk products (M·Q, Mᵀ·P, P·Qᵀ) on CUDA: "tf32" runs them on tensor cores, "fp32" in full
# IEEE fp32. They are most of SC's compute (benchmarks/RESULTS.md#2026-11-22f-sc-tf32). TF32 rounds each product to
# ~5e-4 relative, far below what a rank-r factorisation leaves out, and error feedback carries M - P·Qᵀ exactly as
# applied. The orthonormalisation always runs in IEEE fp32 (``lowrank.orthonormalize``).
MATMUL_PRECISIONS = {"tf32": "tf32", "fp32": "ieee"}


def compression_sizes(shape: torch.Size, rank: int, min_rate: float) -> tuple[bool, int, int]:
    """(compress?, elements before, elements sent) for one gradient viewed as shape[0] x rest (torch's rule)."""
    n = shape[0] if len(shape) else 1
    m = shape.numel() // n if n else 0
    before, factors = n * m, (n + m) * min(n, m, rank)
    compress = factors * min_rate < before
    return compress, before, factors if compress else before


@dataclass
class PowerSGDBuffers:
    """The state that carries from one step to the next, per bucket (what checkpoints and callbacks see)."""

    iter: int = 0
    error_dict: dict[int, Tensor] = field(default_factory=dict)  # error feedback: input - what was applied
    p_memory_dict: dict[int, Tensor] = field(default_factory=dict)  # flat P factors of the last step
    q_memory_dict: dict[int, Tensor] = field(default_factory=dict)  # flat Q factors: the next step's warm start
    rng: np.random.RandomState = field(default_factory=lambda: np.random.RandomState(0))


class DataParallelPowerSGD:
    """Averages a bucket over the data-parallel group through PowerSGD; returns a completed future of the result.

    ``launch`` issues the bucket's collectives in order and returns without waiting on the host (with NCCL the
    GPU stream waits; with gloo the host does).
    """

    def __init__(
        self,
        dp_group: dist.ProcessGroup,
        rank: int = 128,
        warmup_steps: int = 100,
        min_compression_rate: float = 2.0,
        seed: int = 0,
        stats: CommunicationStats | None = None,
        matmul_precision: Literal["tf32", "fp32"] = "tf32",
        guard_nonfinite: bool = False,
    ) -> None:
        """``guard_nonfinite``: a bucket holding NaN or inf on any replica leaves the state (error feedback, warm
        start, step count) as it was and comes back unaveraged, still non-finite, for the strategy to skip the step;
        it costs one host synchronisation per compressed bucket. Off, one such step poisons the error feedback. The
        verdict is per bucket: a stage's other bucket, finite on every replica, compresses as usual (a NaN loss makes
        every gradient non-finite; a NaN confined to some weights' gradients leaves the others' state advanced)."""
        if rank < 1:
            raise ValueError(f"PowerSGD rank={rank!r} must be a positive integer.")
        if matmul_precision not in MATMUL_PRECISIONS:
            raise ValueError(f"matmul_precision={matmul_precision!r}: choose 'tf32' or 'fp32'.")
        self.matmul_precision = matmul_precision
        self.group = dp_group
        self.world_size = dist.get_world_size(dp_group)
        self.matrix_rank, self.min_compression_rate = rank, min_compression_rate
        self.warmup_steps = warmup_steps
        self.state = PowerSGDBuffers(rng=np.random.RandomState(seed))
        self.guard_nonfinite = guard_nonfinite
        self.nonfinite_buckets = 0  # buckets left uncompressed (and state untouched) because they held NaN or inf
        self._step_finite = True
        self.stats = stats
        # Diagnostics: ``observe_step(step) -> bool`` picks steps; ``observer(bucket, exact, compressed)`` then
        # gets the exact average (one extra plain all-reduce on those steps only) and PowerSGD's result.
        self.observe_step: Callable[[int], bool] | None = None
        self.observer: Callable[[int, Tensor, Tensor], None] | None = None
        self._exact: dict[int, Tensor] = {}

    @property
    def compressing(self) -> bool:
        return self.state.iter >= self.warmup_steps

    def launch(self, index: int, flat: Tensor, shapes: Sequence[torch.Size], is_last: bool) -> torch.futures.Future:
        """Average ``flat`` (the bucket's gradients, laid out as ``shapes``) in place; ``is_last`` ends the step."""
        if not self.compressing:
            if self.stats is not None:
                self.stats.add("dp_gradients", flat.numel() * flat.element_size())
            dist.all_reduce(flat, group=self.group)
            result = flat.div_(self.world_size)
        else:
            if self.observer is not None and self.observe_step is not None and self.observe_step(self.state.iter):
                exact = flat.clone()
                dist.all_reduce(exact, group=self.group)
                self._exact[index] = exact.div_(self.world_size)
            result = self._compress_and_average(index, flat, shapes)
        if is_last:
            if self._step_finite:  # a non-finite step is skipped: it does not count towards the warm-up either
                self.state.iter += 1
            self._step_finite = True
        future: torch.futures.Future = torch.futures.Future()
        future.set_result(result)
        return future

    def _compress_and_average(self, index: int, flat: Tensor, shapes: Sequence[torch.Size]) -> Tensor:
        s = self.state
        error = s.error_dict.get(index)
        if error is None:  # the bucket's error-feedback buffer, allocated once and rewritten in place every step
            error = s.error_dict[index] = torch.zeros_like(flat)
        else:
            flat.add_(error)
        exact: list[tuple[Tensor, Tensor]] = []  # (gradient view, its error view)
        groups: dict[tuple[int, int], list[tuple[Tensor, Tensor]]] = {}  # by matrix shape (n, m)
        offset, before, after = 0, 0, 0
        for shape in shapes:
            size = shape.numel()
            views = (flat[offset : offset + size], error[offset : offset + size])
            compress, numel, sent = compression_sizes(shape, self.matrix_rank, self.min_compression_rate)
            if compress:
                n = shape[0]
                groups.setdefault((n, size // n), []).append(views)
            else:
                exact.append(views)
            before += numel * flat.element_size()
            after += sent * (4 if compress else flat.element_size())
            offset += size
        if self.stats is not None:
            self.stats.add("dp_gradients", before, after)

        exact_flat = torch.cat([v for v, _ in exact]) if exact else flat.new_empty(0)
        exact_work = dist.all_reduce(exact_flat, group=self.group, async_op=True)

        rank = {shape: min(*shape, self.matrix_rank) for shape in groups}
        fresh = index not in s.q_memory_dict
        if self.guard_nonfinite:  # what a non-finite bucket must leave as it was (the error buffer is written last)
            saved_q = None if fresh else s.q_memory_dict[index].clone()
            saved_rng = s.rng.get_state()
        if fresh:
            p_size = sum(len(g) * n * rank[(n, m)] for (n, m), g in groups.items())
            q_size = sum(len(g) * m * rank[(n, m)] for (n, m), g in groups.items())
            s.p_memory_dict[index] = torch.empty(p_size, device=flat.device, dtype=torch.float32)
            s.q_memory_dict[index] = torch.empty(q_size, device=flat.device, dtype=torch.float32)
        ps, qs, matrices, p_at, q_at = [], [], [], 0, 0
        for (n, m), pairs in groups.items():
            b, r = len(pairs), rank[(n, m)]
            matrices.append(_batched_view(flat, error, pairs, n, m))
            ps.append(s.p_memory_dict[index][p_at : p_at + b * n * r].view(b, n, r))
            qs.append(s.q_memory_dict[index][q_at : q_at + b * m * r].view(b, m, r))
            p_at, q_at = p_at + b * n * r, q_at + b * m * r
        if fresh:  # the same random Q on every replica: seeded from the shared generator, drawn on the CPU
            # A generator of its own: torch.manual_seed would also reseed the CUDA generators, i.e. dropout's streams.
            generator = torch.Generator().manual_seed(s.rng.randint(1_000_000_000))
            for q in qs:
                q.copy_(torch.randn(*q.shape, generator=generator, device="cpu", dtype=torch.float32))
        precision = MATMUL_PRECISIONS[self.matmul_precision]
        for (matrix, _), p, q in zip(matrices, ps, qs, strict=True):
            q.copy_(orthonormalize(q))
            with fp32_matmul_precision(precision):
                torch.bmm(matrix, q, out=p)
        dist.all_reduce(s.p_memory_dict[index], group=self.group)  # summed: orthonormalised next, scale irrelevant
        if self.guard_nonfinite:
            # NaN and inf survive the sums, so every replica of the group reaches the same verdict here without a
            # collective of its own; the state is still as the previous step left it, but for Q (restored).
            exact_work.wait()
            finite = torch.isfinite(s.p_memory_dict[index]).all() & torch.isfinite(exact_flat).all()
            if not bool(finite):
                if fresh:
                    del s.p_memory_dict[index], s.q_memory_dict[index]
                    s.rng.set_state(saved_rng)
                else:
                    s.q_memory_dict[index].copy_(saved_q)
                self.nonfinite_buckets += 1
                self._step_finite = False
                return flat
        for (matrix, _), p, q in zip(matrices, ps, qs, strict=True):
            p.copy_(orthonormalize(p))
            with fp32_matmul_precision(precision):
                torch.bmm(matrix.mT, p, out=q)
        dist.all_reduce(s.q_memory_dict[index], group=self.group)
        s.q_memory_dict[index].div_(self.world_size)
        # One product P·Qᵀ, applied on every replica (the same factors give the same bits everywhere); the error
        # kept is the input minus exactly that product, as in torch's hook.
        for ((n, m), pairs), (matrix, error_matrix), p, q in zip(groups.items(), matrices, ps, qs, strict=True):
            if error_matrix is not None:  # views of the bucket and of its error buffer: written in place
                error_matrix.copy_(matrix)
                with fp32_matmul_precision(precision):
                    torch.bmm(p, q.mT, out=matrix)
                error_matrix.sub_(matrix)
            else:
                with fp32_matmul_precision(precision):
                    approximation = torch.bmm(p, q.mT)
                residual = matrix.sub_(approximation)
                for i, (view, error_view) in enumerate(pairs):
                    error_view.view(n, m).copy_(residual[i])
                    view.view(n, m).copy_(approximation[i])

        exact_work.wait()
        exact_flat.div_(self.world_size)
        offset = 0
        for view, error_view in exact:  # as torch's hook: the error of an exact tensor is local minus average
            average = exact_flat[offset : offset + view.numel()]
            torch.sub(view, average, out=error_view)
            view.copy_(average)
            offset += view.numel()
        return flat

    def finished(self, index: int, result: Tensor) -> None:
        """Called with a bucket's averaged result once it is complete (hands it to the observer if sampled)."""
        exact = self._exact.pop(index, None)
        if exact is not None and self.observer is not None:
            self.observer(index, exact, result)

    def state_dict(self) -> dict:
        s = self.state
        return {"iter": s.iter, "error_dict": dict(s.error_dict), "p_memory_dict": dict(s.p_memory_dict),
                "q_memory_dict": dict(s.q_memory_dict), "rng_state": s.rng.get_state()}

    def load_state_dict(self, state: dict) -> None:
        s = self.state
        s.iter = state["iter"]
        s.error_dict, s.p_memory_dict, s.q_memory_dict = (dict(state[k]) for k in ("error_dict", "p_memory_dict", "q_memory_dict"))
        s.rng.set_state(state["rng_state"])


def _batched_view(flat: Tensor, error: Tensor, pairs: list[tuple[Tensor, Tensor]], n: int, m: int
                  ) -> tuple[Tensor, Tensor | None]:
    """The group's matrices as one fp32 (b, n, m) batch, and the same batch of its error feedback.

    When the group's tensors lie one after the other in an fp32 bucket (the gradient synchronizer orders an SC
    bucket by shape for this), both are views: nothing is copied and the results are written in place. Otherwise
    (other dtypes, interleaved shapes) the batch is an fp32 copy and the error batch None.
    """
    first = pairs[0][0]
    start = first.data_ptr() - flat.data_ptr()
    adjacent = all(v.data_ptr() == first.data_ptr() + i * n * m * v.element_size() for i, (v, _) in enumerate(pairs))
    if flat.dtype == torch.float32 and adjacent:
        begin, end = start // flat.element_size(), start // flat.element_size() + len(pairs) * n * m
        return flat[begin:end].view(-1, n, m), error[begin:end].view(-1, n, m)
    return torch.stack([v.view(n, m) for v, _ in pairs]).float(), None
