"""The GPU's sustained clock: how much slower a layer's kernels run when the GPU is kept busy, as a training step
keeps it, than in the profiler's short timed passes.

The grids (``planner.timing.measure``) time each layer in a short burst behind a spin kernel that draws little power:
the GPU runs it at its top clock. A device-bound training step keeps the GPU busy for its whole length, draws power
up to the card's limit and runs at the lower clock that limit allows, so its GEMMs take longer than the grid says
(docs/planner.md, "The sustained clock"). The clock the limit leaves depends on the work's power, so it is measured on
the layers themselves: one forward and backward captured as a CUDA graph (no host in the way at any size), replayed
in isolation the way the grid times a layer, then back to back for ``seconds``; the ratio of the two medians is the
layer's slow-down at that token count. ``ProfiledCostModel`` multiplies the grid's device seconds by it
(interpolated in log tokens), for the device-bound steps it prices.
"""

from __future__ import annotations

import math
import statistics
import time

import torch
from torch import nn

from lightning_3d.costs.profiled import TARGET_KINDS  # kinds measured by target tokens, as the cost model reads them
from lightning_3d.utils.compat import device_busy_for

#: at most this many token counts per layer kind, spread evenly in log tokens over the grid's
POINTS = 5
#: token counts above this are not measured: the largest measured ratio holds beyond it (a GEMM this long is at
#: the power limit's clock already, and each replay would take a large share of the sustained loop)
MAX_TOKENS = 65536
#: isolated replays per point (median), and the least back-to-back replays the sustained loop runs
ISOLATED_REPEATS, MIN_SUSTAINED = 5, 8


def pick_points(microbatch_sizes, seq_lens, points: int = POINTS, max_tokens: int = MAX_TOKENS) -> list[tuple[int, int]]:
    """Up to ``points`` (micro-batch size, sequence length) pairs of the grid whose token counts spread evenly in log
    tokens from the grid's smallest to its largest (at most ``max_tokens``); of pairs with equal tokens the longer
    sequence (the shape a training step's micro-batches have)."""
    pairs = sorted({(int(b) * int(s), int(s), int(b)) for b in microbatch_sizes for s in seq_lens})
    lo, hi = pairs[0][0], max((p[0] for p in pairs if p[0] <= max_tokens), default=pairs[0][0])
    chosen: list[tuple[int, int]] = []
    for i in range(points):
        target = math.log(lo) + (math.log(hi) - math.log(lo)) * (i / (points - 1) if points > 1 else 1.0)
        tokens, s, b = min((p for p in pairs if p[0] <= hi), key=lambda p: (abs(math.log(p[0]) - target), -p[1]))
        if (b, s) not in chosen:
            chosen.append((b, s))
    return sorted(chosen, key=lambda bs: bs[0] * bs[1])


def _graphed_pass(module: nn.Module, inputs: tuple, run, device: torch.device, dtype: torch.dtype | None):
    """One forward and backward of ``run(module, *inputs)`` captured as a CUDA graph (after a warm-up on a side
    stream, as torch.cuda.graph asks); the gradients land in buffers of the graph's pool."""

    def params_and_inputs():
        return [*module.parameters(), *(x for x in inputs if isinstance(x, torch.Tensor) and x.requires_grad)]

    def one(grad=None):
        # cache_enabled=False: autocast's weight-cast cache would hold tensors made outside the graph's pool.
        with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None, cache_enabled=False):
            out = run(module, *inputs)
        out.backward(torch.ones_like(out) if grad is None else grad)
        return out

    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(3):
            for t in params_and_inputs():
                t.grad = None
            out = one()
    torch.cuda.current_stream(device).wait_stream(side)
    grad = torch.ones_like(out) if out.dim() == 0 else torch.full_like(out, 1e-3)
    for t in params_and_inputs():
        t.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        one(grad)
    return graph


def sustained_ratio(module: nn.Module, inputs: tuple, run, *, device: torch.device, dtype: torch.dtype | None,
                    seconds: float) -> dict:
    """One point: the pass's device seconds replayed in isolation (behind a low-power spin, after the GPU idled, the
    way the grids are timed) and back to back for ``seconds`` (median of the second half: the clock has settled), and
    their ratio. Raises what capturing raises (the caller records it)."""
    graph = _graphed_pass(module, inputs, run, device, dtype)

    def replay_times(n: int, lead: float) -> list[float]:
        marks = []
        for _ in range(n):
            if lead > 0:
                torch.cuda.synchronize(device)
                time.sleep(lead)  # the GPU idles, as between the grid's timed passes
                device_busy_for(1e-3, device)
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            graph.replay()
            b.record()
            marks.append((a, b))
        torch.cuda.synchronize(device)
        return [a.elapsed_time(b) / 1e3 for a, b in marks]

    replay_times(2, 0.0)  # first replays: uploads, not timed
    isolated = statistics.median(replay_times(ISOLATED_REPEATS, 0.02))
    count = max(MIN_SUSTAINED, int(seconds / max(isolated, 1e-6)))
    held = replay_times(count, 0.0)
    sustained = statistics.median(held[len(held) // 2:])
    return {"isolated_seconds": isolated, "sustained_seconds": sustained, "ratio": sustained / isolated,
            "replays": count}


def measure_sustained(layers: dict, kinds, microbatch_sizes, seq_lens, targets, *, device: torch.device,
                      dtype: torch.dtype | None, seconds: float, log=print) -> dict:
    """The profile's ``sustained`` section: per layer kind of ``kinds`` (the recipe's ``layers``), the points
    ``pick_points`` chooses, each with its tokens (micro-batch size x sequence length; x target length for
    ``TARGET_KINDS`` where there are ``targets``, at the longest sequence) and ratio; a point that runs out of memory is
    left out, and a kind whose capture fails gets its error instead (the cost model then leaves it at its grid's
    times)."""
    section: dict = {"seconds": seconds, "kinds": {}}
    for kind in kinds:
        module, make, run = layers[kind]
        module.to(device)
        on_target = kind in TARGET_KINDS and bool(targets)
        lengths = targets if on_target else seq_lens
        entry: dict = {"shape": [], "tokens": [], "ratio": [], "isolated_seconds": [], "sustained_seconds": []}
        try:
            for b, s in pick_points(microbatch_sizes, lengths):
                seq, target = (seq_lens[-1], s) if on_target else (s, targets[-1] if targets else s)
                try:
                    point = sustained_ratio(module, make(b, seq, target, dtype or torch.float32), run, device=device,
                                            dtype=dtype, seconds=seconds)
                except torch.OutOfMemoryError:
                    # The graph's pool holds the pass's activations and gradients at once, like the grid's largest
                    # points: a point that does not fit is left out, the kind's other points stand.
                    log(f"sustained clock of {kind} at {b} x {s}: out of memory, left out")
                    torch.cuda.empty_cache()
                    continue
                entry["shape"].append([b, seq, target])  # micro-batch size, sequence and target length
                entry["tokens"].append(b * s)
                for q in ("ratio", "isolated_seconds", "sustained_seconds"):
                    entry[q].append(round(point[q], 9))
                torch.cuda.empty_cache()
        except Exception as err:  # noqa: BLE001  a layer that cannot be captured keeps its grid's times
            log(f"sustained clock of {kind} not measured: {type(err).__name__}: {err}")
            entry = {"error": f"{type(err).__name__}: {err}"[:500]}
            torch.cuda.empty_cache()
        else:
            if entry["tokens"]:
                log(f"sustained clock of {kind}: "
                    + ", ".join(f"{t} tokens x{r:.3f}" for t, r in zip(entry["tokens"], entry["ratio"])))
            else:
                entry = {"error": "every point ran out of memory"}
                log(f"sustained clock of {kind} not measured: every point ran out of memory")
        section["kinds"][kind] = entry
        for p in module.parameters():
            p.grad = None
        module.to("cpu")
    return section
