"""Timing a recipe's layers at tp = 1: the profile document's layer grids, call overheads and optimizer step.

``profile_layers`` builds the recipe's layers (``RecipeCosts.layers``, from the registry), fuses them as the strategy
trains them, and times each layer kind over the grid of micro-batch size x sequence length (x target length for
T5), with and without activation checkpointing, eager and (``compile``) compiled; then the AdamW step over tensors
shaped like the whole model's. It is the one function that times layers: ``lightning-3d profile``
(``planner.profile.profile_model``) calls it for the real model, and the overheads' measurement
(``planner.overheads``) for the tiny model it trains.
"""

from __future__ import annotations

import copy
import math
import os
import statistics
import time
from dataclasses import replace

import torch
from torch import nn

from lightning_3d.costs import ClusterSpec, DeviceSpec, ModelShape, device_spec, new_profile, recipe_costs
from lightning_3d.distributed.wgrad_fusion import check_fusion_mode, fuse_standalone, unfuse_gradient_accumulation
from lightning_3d.planner.api import BYTES, workload_from_config
from lightning_3d.planner.clocks import measure_sustained
from lightning_3d.planner.timing import QUANTITIES, grid_get, grid_indices, grid_set, measure_optimizer, model_tensors, nested, time_point


class NoCost:
    """A cost model that prices nothing: ``workload_from_config`` asked only for the shape and lengths."""

    source = "none"


def grid_lengths(cfg: dict, seq_lens=None, target_lens=None) -> tuple[ModelShape, list[int], list[int] | None]:
    """The config's model shape and the sequence (and, for T5, target) lengths its grids cover: those given, else
    up to three shorter powers of two and the config's own length."""
    w = workload_from_config(cfg, ClusterSpec.single_node(1), cost_model=NoCost())
    seqs = sorted(set(seq_lens or _default_lengths(w.seq_len)))
    targets = None
    if w.shape.family == "t5":
        targets = sorted(set(target_lens or _default_lengths(w.target_len or w.seq_len)))
    return w.shape, seqs, targets


def precision_of(cfg: dict) -> str:
    return str((cfg.get("trainer") or {}).get("precision", "32-true"))


def resolve_device(device: str | torch.device | None) -> torch.device:
    """``device`` as a ``torch.device``; None: the current GPU, refused with the alternatives where none is visible."""
    if device is None:
        if not torch.cuda.is_available():
            raise RuntimeError("`lightning-3d profile` measures a GPU and none is visible. Run it on the GPU you will"
                               " train on, plan with the analytic model (no --profile), or pass --device cpu to profile"
                               " the CPU (tests only).")
        device = torch.device("cuda", torch.cuda.current_device())
    return torch.device(device)


def profile_layers(cfg: dict, device: torch.device, *, microbatch_sizes=(1, 2, 4, 8), seq_lens=None, target_lens=None,
                   recompute=(False, True), warmup: int = 2, repeats: int = 5, compile: bool | str = False,
                   fuse_gradients: bool | str = "auto", compile_recompute=(False,), compile_microbatch_sizes=None,
                   eager: bool = True, sustained_seconds: float = 0.0, call_overhead: dict | None = None,
                   log=print) -> dict:
    """A profile document of ``cfg``'s model on ``device`` holding its layers (``layers``, ``call_overhead``), the
    fusion they were timed under (``gradient_accumulation_fusion``, ``fused_weights``), the optimizer's step
    (``optimizer``) and, on a GPU with ``sustained_seconds`` > 0, the layers' slow-down at the sustained clock
    (``sustained``: ``planner.clocks``); ``planner.profile.profile_model`` documents the arguments. ``call_overhead``
    (a profile's ``{"forward_seconds", "backward_seconds"}``): the per-call fixed cost to take off single timings,
    instead of the median this run's chains give (grids added to a profile that has one, ``add_compiled``: the same
    rule as the profile's own grids). The layers are released (unfused, back on the CPU) when it returns."""
    check_fusion_mode(fuse_gradients, "fuse_gradients")
    if call_overhead is not None:
        values = [call_overhead.get(k) if isinstance(call_overhead, dict) else None
                  for k in ("forward_seconds", "backward_seconds")]
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0
                   for v in values):
            raise ValueError(f"call_overhead={call_overhead!r}: give a profile's call_overhead, non-negative seconds"
                             " under 'forward_seconds' and 'backward_seconds' (or None to measure it here)")
    started = time.perf_counter()
    shape, seq_lens, targets = grid_lengths(cfg, seq_lens, target_lens)
    precision = precision_of(cfg)
    dtype = torch.bfloat16 if BYTES.get(precision, 4) == 2 and device.type == "cuda" else None
    doc = new_profile(shape, _device_spec(device), precision=precision, torch_version=torch.__version__,
                      created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    model = cfg.get("model") or {}
    recipe = recipe_costs(model.get("class_path", "lightning_3d.recipes.GPT"))
    if recipe.layers is None:
        raise ValueError(f"the recipe {model.get('class_path')!r} registers no layers to profile.")
    layers = recipe.layers(dict(model.get("init_args") or {}), dict((cfg.get("data") or {}).get("init_args") or {}), shape, device)
    # The layers as the strategy trains them: its gradient-accumulation fusion turns their nn.Linear into
    # FusedGradLinear (weight gradients added in fp32 inside the backward's GEMM, through a custom op); under "auto"
    # only the large ones, by the same rule (per weight, so a layer kind fuses alike in the profile and in any stage).
    # On the device first: a fused layer's gradient slot is a buffer, and moving the module afterwards would replace
    # it with a copy that the slot registry does not know.
    for module, _, _ in layers.values():
        module.to(device)
    fused = {kind: fuse_standalone(module, fuse_gradients, "fuse_gradients") for kind, (module, _, _) in layers.items()}
    variants = [(kind, rc, False) for kind in layers for rc in (recompute if kind not in ("embedding", "head") else (False,))
                if eager]
    if compile:
        # The compiled recipes compile each block and the loss (the head's fp32 cross-entropy): compiled grids of
        # the blocks and the head, on ``compile_microbatch_sizes`` (each new shape may compile again).
        variants += [(kind, rc, True) for kind in layers if kind != "embedding"
                     for rc in (compile_recompute if kind != "head" else (False,))]
    grids = dict(microbatch_sizes=microbatch_sizes, compile_microbatch_sizes=compile_microbatch_sizes,
                 seq_lens=seq_lens, targets=targets, device=device, dtype=dtype, warmup=warmup, repeats=repeats)
    calls, single = [], []  # per-call fixed costs (from the chains); grids still holding T(1)
    for kind, rc, compiled in variants:
        try:
            _profile_variant(doc, layers, kind, rc, compiled, compile, fuse_gradients, grids, calls, single)
        except Exception as err:  # noqa: BLE001
            if not compiled:
                raise
            # A compile that fails (no compiler, an unsupported op) leaves the eager profile whole: no compiled grid,
            # which ProfiledCostModel(compiled=True) then names.
            log(f"compiled {kind} not profiled: {type(err).__name__}: {err}")
            doc.setdefault("compile_errors", []).append(f"{kind}: {type(err).__name__}: {err}"[:500])
            if device.type == "cuda":
                torch.cuda.empty_cache()
        else:
            log(f"profiled {kind} recompute={rc}{' compiled' if compiled else ''}"
                f" ({time.perf_counter() - started:.1f} s)")
    _finish_profile_layers(doc, calls, single, call_overhead)
    if sustained_seconds > 0 and device.type == "cuda":
        # The embedding's lookup and gather are a small, memory-bound share of a step: left at its grid's times.
        doc["sustained"] = measure_sustained(layers, [k for k in layers if k != "embedding"], microbatch_sizes,
                                             seq_lens, targets, device=device, dtype=dtype, seconds=sustained_seconds,
                                             log=log)
    doc["gradient_accumulation_fusion"] = fuse_gradients
    doc["fused_weights"] = {kind: len(weights) for kind, weights in fused.items()}
    doc["optimizer"] = _time_optimizer(recipe.optimizer(dict(model.get("init_args") or {}), device)
                                       if recipe.optimizer else None, layers, shape, device, warmup, repeats)
    log("optimizer measured")
    for weights in fused.values():
        unfuse_gradient_accumulation(weights)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return doc


def add_sustained(doc: dict, cfg: dict, device: torch.device | str | None = None, *, seconds: float = 1.0,
                  log=print) -> dict:
    """``doc`` (a profile of ``cfg``'s model, written without the sustained clock) with its ``sustained`` section
    measured now on ``device`` (default: the current GPU) over the micro-batch sizes and lengths of its grids, the
    layers fused as the profile records (``gradient_accumulation_fusion``); ``doc`` is changed in place and
    returned. For profiles measured before the term: the grids stand, only the clock's factor is added."""
    device = resolve_device(device)
    if device.type != "cuda":
        raise ValueError(f"the sustained clock is a GPU's (device {device}); the CPU profile has none.")
    shape, _, _ = grid_lengths(cfg)
    model = cfg.get("model") or {}
    layers = recipe_costs(model.get("class_path", "lightning_3d.recipes.GPT")).layers(
        dict(model.get("init_args") or {}), dict((cfg.get("data") or {}).get("init_args") or {}), shape, device)
    grid = next(e for e in doc["layers"].get("block", doc["layers"].get("encoder_block", [])) if e["tp"] == 1)
    decoder = [e for e in doc["layers"].get("decoder_block", []) if e["tp"] == 1]
    targets = decoder[0]["target_len"] if decoder else None
    fusion = doc.get("gradient_accumulation_fusion", "auto")
    fused = {}
    for kind, (module, _, _) in layers.items():
        module.to(device)
        fused[kind] = fuse_standalone(module, fusion, "fuse_gradients")
    dtype = torch.bfloat16 if BYTES.get(precision_of(cfg), 4) == 2 else None
    doc["sustained"] = measure_sustained(layers, [k for k in layers if k != "embedding"], grid["microbatch_size"],
                                         grid["seq_len"], targets, device=device, dtype=dtype, seconds=seconds, log=log)
    for weights in fused.values():
        unfuse_gradient_accumulation(weights)
    torch.cuda.empty_cache()
    return doc


def _time_optimizer(implementation: dict | None, layers: dict, shape: ModelShape, device: torch.device, warmup: int,
                    repeats: int) -> dict:
    """The AdamW step (``implementation``: its ``foreach``/``fused`` arguments) over tensors shaped like the whole
    model's, or over one block where they would not fit."""
    tensors = model_tensors(layers, shape, device)
    if tensors is not None:
        return measure_optimizer(tensors, device, warmup, repeats, implementation)
    block = layers.get("block", layers.get("encoder_block"))[0]
    return measure_optimizer(block, device, warmup, repeats, implementation)


def _profile_variant(doc, layers, kind, rc, compiled, compile, fuse_gradients, grids: dict, calls: list,
                     single: list) -> None:
    """One layer kind's grid (recompute or not, compiled or not) into ``doc``; the chains' fixed costs into
    ``calls`` ((compiled, forward, backward), eager forward passes only) and the grid points still holding one into
    ``single``."""
    base, make, run = layers[kind]
    base.to(grids["device"])
    module = base
    if compiled and kind == "head":
        run = torch.compile(run, **_compile_options(compile))
    elif compiled:
        module = _compiled(base, compile, fuse_gradients)
    doc["layers"].setdefault(kind, [])
    targets, dtype = grids["targets"], grids["dtype"]
    # The encoder never sees the target: its grid has no target axis.
    with_target = targets if kind != "encoder_block" else None
    sizes = grids["compile_microbatch_sizes"] if compiled and grids["compile_microbatch_sizes"] else grids["microbatch_sizes"]
    axes = [list(sizes), grids["seq_lens"]] + ([with_target] if with_target else [])
    grid = {q: nested(axes) for q in QUANTITIES}
    kw = dict(recompute=rc, device=grids["device"], dtype=dtype, warmup=grids["warmup"], repeats=grids["repeats"])
    fixed_at: dict[tuple, tuple | None] = {}  # per point: its chain's fixed cost, None where it holds a single timing

    def measure_at(idx):
        b, s = axes[0][idx[0]], axes[1][idx[1]]
        t = axes[2][idx[2]] if with_target else (targets[-1] if targets else s)
        one, fixed = time_point(module, lambda: make(b, s, t, dtype or torch.float32), run,
                                chained=kind not in ("embedding", "head"), **kw)
        if one is None and idx in fixed_at:
            return  # out of memory when measured again (memory another point left behind): the first timing stays
        for q in QUANTITIES:
            grid_set(grid[q], idx, None if one is None else one[q])
        if one is not None:
            fixed_at[idx] = fixed

    for idx in grid_indices(axes):
        if idx[0] > 0 and grid_get(grid["forward"], (idx[0] - 1, *idx[1:])) is None:
            continue  # a smaller micro-batch of these lengths ran out of memory: so would this one
        measure_at(idx)
    remeasured = remeasure_outliers(grid, axes, measure_at)
    for idx, fixed in fixed_at.items():
        if fixed is not None and not rc:  # samples of the call's fixed cost, eager and compiled apart
            calls.append((compiled, *fixed))
        elif fixed is None:
            single.append((grid, idx))
    entry = {"tp": 1, "recompute": rc, "microbatch_size": axes[0], "seq_len": axes[1],
             "target_len": axes[2] if with_target else None, **grid}
    if remeasured:
        entry["remeasured"] = remeasured
    if compiled:
        entry["compiled"] = True
    doc["layers"][kind].append(entry)
    if compiled and module is not base:
        unfuse_gradient_accumulation(list(module.parameters()))  # the copy's slots, out of the registry
    module = None  # the compiled copy released before the next kind (measure_at is done with it)
    base.to("cpu")


#: a grid point whose forward or backward seconds are below this share of a point with less work (one step smaller
#: along one axis, the others equal) is a failed timing, measured again (``remeasure_outliers``)
OUTLIER_SHARE = 0.9
#: ... and by more than this many seconds: below it, a launch-bound layer's timings wander by themselves (the
#: embedding's gather at small shapes), which the cost model's monotone read pools; a failed timing is far larger
OUTLIER_FLOOR_S = 50e-6
#: times an outlying pair of points is measured again before the grid keeps what it has
REMEASURE_ROUNDS = 2


def _outliers(grid: dict, axes: list) -> list[tuple[tuple, tuple]]:
    """Pairs (point, its smaller neighbour) where the point's forward or backward time is below ``OUTLIER_SHARE`` of
    the neighbour's and by more than ``OUTLIER_FLOOR_S``, though it does strictly more of the same work."""
    pairs = []
    for idx in grid_indices(axes):
        for d in range(len(axes)):
            if idx[d] == 0:
                continue
            smaller = (*idx[:d], idx[d] - 1, *idx[d + 1:])
            for q in ("forward", "backward"):
                big, small = grid_get(grid[q], idx), grid_get(grid[q], smaller)
                if big is not None and small is not None and big < OUTLIER_SHARE * small and small - big > OUTLIER_FLOOR_S:
                    pairs.append((idx, smaller))
                    break
    return pairs


def remeasure_outliers(grid: dict, axes: list, measure_at) -> list[dict]:
    """Measure again both points of each pair where a layer's time falls though its work grows (``_outliers``), up to
    ``REMEASURE_ROUNDS`` times; returns what was measured again, before and after, for the profile's record.

    More tokens or rows of one layer cannot take less time: such a pair holds one failed timing, low or high. Seen on
    an H200: every point of one token count of a compiled grid timed far below its neighbours in one process and
    right in the next (benchmarks/RESULTS.md#2026-12-02g-compiled), which would have priced those micro-batches far
    below their cost; that one was the lead's spin ending early (``compat.device_busy_for``, calibrated at the top
    clock since), and this check stays for whatever else makes a timing fail. Measuring both points again finds
    either failure; an ordering that persists is kept (the cost model's monotone fit pools it when read) and marked
    as persisting in the record."""
    record: dict[tuple, dict] = {}
    for _ in range(REMEASURE_ROUNDS):
        pairs = _outliers(grid, axes)
        if not pairs:
            break
        for idx in sorted({p for pair in pairs for p in pair}):
            entry = record.setdefault(idx, {"point": list(idx), "before": {q: grid_get(grid[q], idx)
                                                                        for q in ("forward", "backward")}})
            measure_at(idx)
            entry["after"] = {q: grid_get(grid[q], idx) for q in ("forward", "backward")}
    persisting = {p for pair in _outliers(grid, axes) for p in pair}
    return [{**entry, "persists": idx in persisting} for idx, entry in sorted(record.items())]


def _finish_profile_layers(doc, calls, single, call_overhead: dict | None = None) -> None:
    # A single timing holds one call's fixed costs besides the layer: T(1) = fixed + marginal, and with the chain
    # T(CHAIN) = fixed + CHAIN * marginal, so fixed = T(CHAIN) - CHAIN * marginal (timing.time_point).
    def median(position):
        # The eager blocks' samples (the stage's call is eager code); a compiled-only profile has only compiled ones.
        eager = [c[position] for c in calls if not c[0]]
        return statistics.median(eager or [c[position] for c in calls]) if calls else 0.0

    if call_overhead is not None:
        fixed_f, fixed_b = float(call_overhead["forward_seconds"]), float(call_overhead["backward_seconds"])
    else:
        fixed_f, fixed_b = median(1), median(2)
    for grid, idx in single:
        for q, fixed in (("forward", fixed_f), ("backward", fixed_b)):
            value = grid_get(grid[q], idx)
            # Where the median call cost is not below this single timing (noise), the timing stands (an
            # overestimate by at most that cost) rather than a layer that costs nothing.
            grid_set(grid[q], idx, value - fixed if value > fixed else value)
    doc["call_overhead"] = {"forward_seconds": fixed_f, "backward_seconds": fixed_b}


def _compiled(module: nn.Module, mode: bool | str, fused: bool | str) -> nn.Module:
    """A compiled copy of ``module`` as the recipes compile their blocks (``Module.compile``, inductor); the copy's
    fused layers (``fused``: the fusion setting) get gradient slots of their own."""
    compiled = copy.deepcopy(module)
    fuse_standalone(compiled, fused)
    compiled.compile(**_compile_options(mode))
    return compiled


def _compile_options(mode: bool | str) -> dict:
    # The recipes' backend (L3D_COMPILE_BACKEND, default inductor: recipes/training.py); a mode only for inductor.
    backend = os.environ.get("L3D_COMPILE_BACKEND", "inductor")
    return {"backend": backend, "mode": (None if mode is True else mode) if backend == "inductor" else None}


def _device_spec(device: torch.device) -> DeviceSpec:
    if device.type != "cuda":
        return DeviceSpec("cpu", 1e11, 2e10, 8 * 2**30)
    name, total = torch.cuda.get_device_name(device), float(torch.cuda.get_device_properties(device).total_memory)
    # Peak and bandwidth from the table (the profile measures layers, not the chip); the memory as the card says.
    try:
        return replace(device_spec(name), memory_bytes=total)
    except ValueError:
        return DeviceSpec(name, 0.0, 0.0, total)


def _default_lengths(n: int) -> list[int]:
    out = [x for x in (128, 256, 512, 1024, 2048, 4096) if x < n]
    return out[-3:] + [n]
