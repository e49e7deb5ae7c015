"""Timing one layer and the optimizer: the profiler's measuring primitives, shared by every grid it measures
(``planner.layers`` at tp = 1, ``planner.multi_gpu`` for tensor-parallel shards).

``measure`` times a module's forward and backward (CUDA events behind a lead on a GPU, the host's seconds beside
them; docs/planner.md, "Device and host times"); ``time_point`` turns a single call and a chain of ``CHAIN`` calls into
the per-layer time and the call's fixed cost; the grid helpers index the nested lists a profile stores;
``measure_optimizer`` times an AdamW step as the recipes build it.
"""

from __future__ import annotations

import itertools
import math
import statistics
import time
from collections import Counter

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_3d.costs import ModelShape
from lightning_3d.utils.compat import device_busy_for

#: the quantities of a layer's grid, in the profile's keys
QUANTITIES = ("forward", "backward", "host_forward", "host_backward", "stored", "peak")


class _Timer:
    """Spans of work on ``device``: CUDA events (the GPU's time from the first to the last kernel) and the host's own
    seconds to issue the work (``perf_counter``, no synchronisation).

    ``lead`` (seconds): the GPU is kept busy that long before the span's first kernel (``compat.device_busy_for``), so
    that a host slower than the layer's kernels has queued them all before the GPU reaches them: the events then time
    the kernels alone. Without it, a host-bound layer's span is its host's launch time (the GPU idles between
    launches), and the planner, which takes the host's time as a term of its own (``costs.host``: max of the two per
    pass), would hold the host in its device term too (docs/planner.md, "Device and host times")."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.device = device
        #: after a span with a lead: whether the GPU was still in the lead when the host had issued the span's work
        self.lead_held = True
        #: after ``measure``'s pass: ``lead_held`` of its forward and its backward span
        self.held = (True, True)

    def span(self, fn, lead: float = 0.0):
        if self.cuda:
            if lead > 0:
                device_busy_for(lead, self.device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            t0 = time.perf_counter()
            out = fn()
            host = time.perf_counter() - t0
            # The lead held if the GPU had not yet reached the span's start when the host had issued all of it;
            # otherwise the GPU may have waited for the host inside the span (``lead_held``).
            self.lead_held = lead <= 0 or not start.query()
            end.record()
            return out, (start, end), host
        t0 = time.perf_counter()
        out = fn()
        host = time.perf_counter() - t0
        return out, host, host

    def seconds(self, mark) -> float:
        if self.cuda:
            return mark[0].elapsed_time(mark[1]) / 1e3
        return mark


#: the GPU's lead over a timed device span: this many times the host's seconds for the same pass on an idle GPU, plus
#: ``LEAD_FLOOR`` seconds (a lead shorter than the host's time lets the GPU catch up and idle inside the span)
LEAD_FACTOR, LEAD_FLOOR = 2.0, 1e-3


#: a device pass whose lead ran out before the host had issued it (``_Timer.lead_held``) is run again with this many
#: times the lead, up to ``LEAD_RETRIES`` times; the last run stands
LEAD_GROWTH, LEAD_RETRIES = 4.0, 3
#: device passes measured and those run again for a lead that ran out, in this process (a profile's diagnostics)
LEAD_RERUNS: Counter = Counter()

#: layers applied this many times in a row for the per-layer (marginal) time: see ``time_point``
CHAIN = 3


def measure(module: nn.Module, inputs: tuple, run, *, recompute: bool, device: torch.device, dtype: torch.dtype | None,
            warmup: int, repeats: int, chain: int = 1) -> dict | None:
    """Medians of one forward and backward through ``module`` applied ``chain`` times in a row (the output fed
    back as the first input: blocks only), or None when the shape runs out of memory. Keys: forward, backward
    (span seconds; on a GPU the kernels' alone, timed behind a lead: ``_Timer``), host_forward, host_backward
    (seconds the host took to issue them, on an idle GPU), stored, peak (bytes; chain 1 only, else 0)."""
    timer = _Timer(device)
    cuda = device.type == "cuda"
    rows = {k: [] for k in ("forward", "backward", "host_forward", "host_backward", "stored", "peak")}

    def once(args):
        if recompute:
            return checkpoint(run, module, *args, use_reentrant=False)
        return run(module, *args)

    def forward():
        with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
            out = once(inputs)
            for _ in range(chain - 1):
                out = once((out, *inputs[1:]))
            return out

    def one_pass(lead_f: float, lead_b: float):
        """One forward and backward: (forward span, backward span, host forward, host backward, stored, peak)."""
        for p in module.parameters():
            p.grad = None
        for x in inputs:
            if isinstance(x, torch.Tensor) and x.requires_grad:
                x.grad = None
        if cuda:
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
        out, f_mark, f_host = timer.span(forward, lead_f)
        forward_held = timer.lead_held
        if cuda:
            after = torch.cuda.memory_allocated(device)
        grad = torch.ones_like(out) if out.dim() == 0 else torch.randn_like(out)
        if cuda:
            # The gradient's random numbers are not the layer's work: done before the backward's span starts.
            torch.cuda.synchronize(device)
        _, b_mark, b_host = timer.span(lambda out=out, grad=grad: out.backward(grad), lead_b)
        timer.held = (forward_held, timer.lead_held)
        stored = peak = 0
        if cuda:
            torch.cuda.synchronize(device)
            top = torch.cuda.max_memory_allocated(device)
            # Kept for the backward: what the forward left allocated, its output included (the next layer keeps it
            # as its input, which was allocated before this layer's baseline: each tensor between layers is counted
            # once, by its producer); and the transient on top while forward and backward ran.
            stored, peak = max(0, after - base), max(0, top - after)
        del out, grad
        return timer.seconds(f_mark), timer.seconds(b_mark), f_host, b_host, stored, peak

    try:
        for i in range(warmup + repeats):
            # On a GPU two passes per repeat: the host's times and the memory on an idle GPU (the state a host-bound
            # step is in), then the device spans with the GPU kept busy for longer than the host takes to issue the
            # pass, so that they hold the kernels alone (docs/planner.md, "Device and host times"). Elsewhere the
            # span is the host's time: one pass.
            f_dev, b_dev, f_host, b_host, stored, peak = one_pass(0.0, 0.0)
            if cuda:
                lead_f, lead_b = LEAD_FACTOR * f_host + LEAD_FLOOR, LEAD_FACTOR * b_host + LEAD_FLOOR
                f_dev, b_dev, *_ = one_pass(lead_f, lead_b)
                LEAD_RERUNS["passes"] += 1
                # A host that issued this pass slower than the idle pass (a collection, another process on its
                # cores, a compiled graph's guards) can outrun the lead: the span would then hold the GPU's wait.
                for _ in range(LEAD_RETRIES):
                    if timer.held == (True, True):
                        break
                    lead_f, lead_b = lead_f * LEAD_GROWTH, lead_b * LEAD_GROWTH
                    f_dev, b_dev, *_ = one_pass(lead_f, lead_b)
                    LEAD_RERUNS["reruns"] += 1
            if i >= warmup:
                rows["forward"].append(f_dev)
                rows["backward"].append(b_dev)
                rows["host_forward"].append(f_host)
                rows["host_backward"].append(b_host)
                if cuda and chain == 1:
                    rows["stored"].append(stored)
                    rows["peak"].append(peak)
    except torch.OutOfMemoryError:
        if cuda:
            torch.cuda.empty_cache()
        return None
    med = statistics.median
    return {k: float(med(v)) if v else 0.0 for k, v in rows.items()}


def marginal(one: float, many: float, chain: int) -> float:
    """Seconds one more application of a layer adds: (T(chain) - T(1)) / (chain - 1), within [0, T(1)] (a layer
    cannot cost less than nothing nor more than a call of its own; outside is measurement noise)."""
    return min(max((many - one) / (chain - 1), 0.0), one)


def time_point(module: nn.Module, make_inputs, run, *, chained: bool, **kw) -> tuple[dict | None, tuple | None]:
    """One grid point of a layer: ``measure`` of one call (fresh inputs from ``make_inputs()``) and, when
    ``chained``, of a chain of ``CHAIN`` (block-like layers whose output feeds the next). Returns the single call's
    timings, or None when out of memory, with forward, backward and the host's times replaced by the per-layer
    (marginal) time where the chain is consistent; and that chain's fixed cost per call (forward, backward) =
    T(CHAIN) - CHAIN * marginal, or None where there is no chain or it was noise (slower per layer than a single
    call, or no faster than it), in which case the single timing still holds a call's fixed cost."""
    one = measure(module, make_inputs(), run, **kw)
    many = measure(module, make_inputs(), run, chain=CHAIN, **kw) if chained and one else None
    if many is None or not all(0 < many[q] - one[q] < (CHAIN - 1) * one[q] for q in ("forward", "backward")):
        return one, None
    fixed = tuple(many[q] - CHAIN * marginal(one[q], many[q], CHAIN) for q in ("forward", "backward"))
    for q in ("forward", "backward", "host_forward", "host_backward"):
        one[q] = marginal(one[q], many[q], CHAIN)
    return one, fixed


def subtract_fixed(grid: dict, single: list[tuple], fixed: dict[str, list[float]]) -> None:
    """Each single timing of ``grid`` (grid points ``single``, whose chain was noise or absent) less the median of the
    call's fixed costs ``fixed[q]`` that consistent chains gave, where it is above it (else the timing stands: an
    overestimate by at most that cost, rather than a layer that costs nothing)."""
    for q in ("forward", "backward"):
        cost = statistics.median(fixed[q]) if fixed[q] else 0.0
        for idx in single:
            value = grid_get(grid[q], idx)
            grid_set(grid[q], idx, value - cost if value > cost else value)


def nested(axes):
    """A grid of None over ``axes`` (nested lists, the first axis outermost)."""
    if len(axes) == 1:
        return [None] * len(axes[0])
    return [nested(axes[1:]) for _ in axes[0]]


def grid_indices(axes):
    return itertools.product(*(range(len(a)) for a in axes))


def grid_get(grid, idx):
    for i in idx:
        grid = grid[i]
    return grid


def grid_set(grid, idx, value):
    for i in idx[:-1]:
        grid = grid[i]
    grid[idx[-1]] = value


def measure_optimizer(module: nn.Module | list[torch.Tensor], device: torch.device, warmup: int, repeats: int,
                      implementation: dict | None = None) -> dict:
    """An AdamW step and ``zero_grad`` as the recipes run them (fp32 state; ``implementation``: the ``foreach``/
    ``fused`` arguments, the registered recipe's answer, ``RecipeCosts.optimizer``; None: torch's default), on ``module``'s parameters or
    on a list of tensors shaped like a whole model's: seconds per step and per parameter (the host's per-tensor
    launches are part of it, which is why the whole model's tensor list is timed)."""
    implementation = dict(implementation or {})
    if isinstance(module, nn.Module):
        module.to(device)
        params = [p for p in module.parameters()]
    else:
        params = module
    grads = [torch.randn_like(p) for p in params]
    optimizer = torch.optim.AdamW(params, lr=1e-4, **implementation)
    times = []
    for i in range(warmup + repeats):
        for p, g in zip(params, grads):
            p.grad = g
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    count = sum(p.numel() for p in params)
    step = statistics.median(times)
    if isinstance(module, nn.Module):
        module.to("cpu")
        for p in params:
            p.grad = None
    del optimizer, grads
    return {"seconds_per_parameter": step / count, "step_seconds": step, "parameters": int(count),
            "tensors": len(params), "optimizer": "torch.optim.AdamW", "implementation": implementation}


def model_tensors(layers: dict, shape: ModelShape, device: torch.device) -> list[torch.Tensor] | None:
    """fp32 tensors shaped like the whole model's parameters on one GPU (each layer kind's module times its count in
    the model, the head's tied copy included as the planner counts it), or None when they and their AdamW state
    would not fit in the free memory (then the optimizer is timed on one block and scaled per parameter)."""
    counts = Counter(shape.layer_kinds())
    shapes = [tuple(p.shape) for kind, (module, _, _) in layers.items() for _ in range(counts.get(kind, 0))
              for p in module.parameters()]
    numel = sum(math.prod(s) for s in shapes)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        if 4 * 4 * numel > 0.8 * free:  # weights, gradients and two moments in fp32
            return None
    return [torch.zeros(s, device=device, requires_grad=True) for s in shapes]

