"""``lightning-3d profile --config MODEL.yaml [--out FILE]``: measure, on the current GPU, each layer kind's forward
and backward time (CUDA events after warm-up, median of repeats) and its stored and peak activation memory
(``torch.cuda`` memory statistics) over a grid of micro-batch size × sequence length (× target length for T5),
with and without activation checkpointing; plus all-reduce, all-gather, reduce-scatter and point-to-point bandwidth
between the visible GPUs when there are several. Writes the versioned JSON profile ``ProfiledCostModel`` reads.

The layers are the recipe's own modules (``Block``; ``EncoderBlock``/``DecoderBlock``; the embedding; final norm,
output projection and loss, as the recipe registers them: ``lightning_3d.costs.RecipeCosts``), built one at a time at full size on one GPU (tensor-parallel shards are derived from
the tp = 1 grid: ``ProfiledCostModel(derive_tp=True)``). On a machine without a GPU the command refuses;
``--device cpu`` profiles the CPU for tests (times of the CPU, memory not measured: 0).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_3d.costs import ClusterSpec, DeviceSpec, ModelShape, device_spec, new_profile, recipe_costs
from lightning_3d.costs.host import in_situ_host_layers, microbatch_overhead_from
from lightning_3d.planner.api import BYTES, load_config, workload_from_config
from lightning_3d.distributed.wgrad_fusion import (check_fusion_mode, choose_fused, fusable_linears,
                                                  fuse_gradient_accumulation, register_slot,
                                                  unfuse_gradient_accumulation)
from lightning_3d.utils.compat import device_busy_for


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

    def span(self, fn, lead: float = 0.0):
        if self.cuda:
            if lead > 0:
                device_busy_for(lead, self.device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            t0 = time.perf_counter()
            out = fn()
            host = time.perf_counter() - t0
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


#: layers applied this many times in a row for the per-layer (marginal) time: see ``profile_model``
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
        if cuda:
            after = torch.cuda.memory_allocated(device)
        grad = torch.ones_like(out) if out.dim() == 0 else torch.randn_like(out)
        if cuda:
            # The gradient's random numbers are not the layer's work: done before the backward's span starts.
            torch.cuda.synchronize(device)
        _, b_mark, b_host = timer.span(lambda: out.backward(grad), lead_b)
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
                f_dev, b_dev, *_ = one_pass(LEAD_FACTOR * f_host + LEAD_FLOOR, LEAD_FACTOR * b_host + LEAD_FLOOR)
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


def _marginal(one: float, many: float, chain: int) -> float:
    """Seconds one more application of a layer adds: (T(chain) - T(1)) / (chain - 1), within [0, T(1)] (a layer
    cannot cost less than nothing nor more than a call of its own; outside is measurement noise)."""
    return min(max((many - one) / (chain - 1), 0.0), one)


def optimizer_implementation(cfg: dict, device: torch.device) -> dict:
    """The AdamW implementation a config's recipe builds on ``device`` (``foreach``/``fused`` keyword arguments): its
    ``optimizer_foreach``/``optimizer_fused`` when set, else the recipes' default (``recipes/training.py``
    ``default_fused``: fused where every parameter is on a GPU, torch's own choice elsewhere). The planner sits beside
    the recipes and cannot import them: the rule is read here from the same config. Fused and foreach steps differ by
    several times on a GPU (one kernel over all tensors against a launch per tensor group)."""
    init = ((cfg.get("model") or {}).get("init_args") or {})
    foreach, fused = init.get("optimizer_foreach"), init.get("optimizer_fused")
    if fused is None and not foreach:
        fused = True if device.type == "cuda" else None
    return {"foreach": foreach, "fused": fused}


def measure_optimizer(module: nn.Module | list[torch.Tensor], device: torch.device, warmup: int, repeats: int,
                      implementation: dict | None = None) -> dict:
    """An AdamW step and ``zero_grad`` as the recipes run them (fp32 state; ``implementation``: the ``foreach``/
    ``fused`` arguments, ``optimizer_implementation``'s answer; None: torch's default), on ``module``'s parameters or
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
    from collections import Counter

    counts = Counter(shape.layer_kinds())
    shapes = [tuple(p.shape) for kind, (module, _, _) in layers.items() for _ in range(counts.get(kind, 0))
              for p in module.parameters()]
    numel = sum(math.prod(s) for s in shapes)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        if 4 * 4 * numel > 0.8 * free:  # weights, gradients and two moments in fp32
            return None
    return [torch.zeros(s, device=device, requires_grad=True) for s in shapes]


def profile_model(config: str | Path | dict, *, device: str | torch.device | None = None, microbatch_sizes=(1, 2, 4, 8),
                  seq_lens=None, target_lens=None, recompute=(False, True), warmup: int = 2, repeats: int = 5,
                  collectives: bool = True, compile: bool | str = False, overheads: bool = True,
                  fuse_gradients: bool | str = "auto", compile_recompute=(False,), compile_microbatch_sizes=None,
                  eager: bool = True, tp_layers: bool = True, tp_recompute=(False,), log=print) -> dict:
    """The profile document of the config's model on ``device`` (default: the current GPU; CPU only if named).

    Per layer kind and grid point: forward and backward seconds of one layer as it runs inside a stage. A block is
    timed applied once and ``CHAIN`` times in a row, and its time is the difference per extra application: in a
    stage the host issues the next layer's kernels while the GPU runs this one's, and a call's fixed costs (the
    first launch on an idle GPU, the autograd engine's start) are paid once per micro-batch, not per layer. Those
    fixed costs (T(1) minus the per-layer time, median over the block grid) are taken off the embedding's and
    head's single timings too. ``host_forward``/``host_backward``: the host's seconds to issue the same (eager
    PyTorch launches every kernel from Python: a small layer is host-bound). ``compile``: also the blocks under
    ``torch.compile`` (grids marked ``compiled``). ``fuse_gradients``: the layers with the strategy's
    gradient-accumulation fusion as ``gradient_accumulation_fusion=fuse_gradients`` applies it (``"auto"``, the
    strategy's default: only weights of at least ``FUSION_MIN_ELEMENTS`` elements; True: every fusable layer; False:
    plain autograd); the document records the setting and how many weights of each layer kind were fused.
    ``eager=False`` with ``compile``: only the compiled grids (to add to an eager profile's layers later). ``overheads``: the per-micro-batch and per-step costs outside
    the layers, from a few steps of a tiny model of the same recipe under the strategy (``measure_overheads``).
    ``tp_layers``: with ``collectives`` on several GPUs, also the recipe's tensor-parallel layers at each degree of
    ``tp_degrees`` (``recompute`` settings ``tp_recompute``), measured across the GPUs with their collectives
    (``measure_tp_layers``); grids with ``"collectives": true`` that the planner reads instead of deriving.
    """
    check_fusion_mode(fuse_gradients, "fuse_gradients")
    if device is None:
        if not torch.cuda.is_available():
            raise RuntimeError("`lightning-3d profile` measures a GPU and none is visible. Run it on the GPU you will"
                               " train on, plan with the analytic model (no --profile), or pass --device cpu to profile"
                               " the CPU (tests only).")
        device = torch.device("cuda", torch.cuda.current_device())
    device = torch.device(device)
    cfg = load_config(config)
    w = workload_from_config(cfg, ClusterSpec.single_node(1), cost_model=_NoCost())
    shape: ModelShape = w.shape
    precision = str((cfg.get("trainer") or {}).get("precision", "32-true"))
    dtype = torch.bfloat16 if BYTES.get(precision, 4) == 2 and device.type == "cuda" else None
    seq_lens = sorted(set(seq_lens or _default_lengths(w.seq_len)))
    targets = None
    if shape.family == "t5":
        targets = sorted(set(target_lens or _default_lengths(w.target_len or w.seq_len)))
    if device.type == "cuda":
        name, total = torch.cuda.get_device_name(device), float(torch.cuda.get_device_properties(device).total_memory)
        # Peak and bandwidth from the table (the profile measures layers, not the chip); the memory as the card says.
        dev = replace(device_spec(name), memory_bytes=total) if _known(name) else DeviceSpec(name, 0.0, 0.0, total)
    else:
        dev = DeviceSpec("cpu", 1e11, 2e10, 8 * 2**30)
    doc = new_profile(shape, dev, precision=precision, torch_version=torch.__version__,
                      created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    started = time.perf_counter()
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
    fused = {kind: _fuse(module, fuse_gradients) for kind, (module, _, _) in layers.items()}
    variants = [(kind, rc, False) for kind in layers for rc in (recompute if kind not in ("embedding", "head") else (False,))
                if eager]
    if compile:
        # The compiled recipes compile each block and the loss (the head's fp32 cross-entropy): compiled grids of
        # the blocks and the head, on ``compile_microbatch_sizes`` (each new shape may compile again).
        variants += [(kind, rc, True) for kind in layers if kind != "embedding"
                     for rc in (compile_recompute if kind != "head" else (False,))]
    call_f, call_b, single = [], [], []  # per-call fixed costs (from the chains); grids still holding T(1)
    for kind, rc, compiled in variants:
        try:
            _profile_variant(doc, layers, kind, rc, compiled, compile, fuse_gradients, compile_microbatch_sizes,
                             microbatch_sizes, seq_lens, targets, device, dtype, warmup, repeats, call_f, call_b,
                             single, started, log)
        except Exception as err:  # noqa: BLE001
            if not compiled:
                raise
            # A compile that fails (no compiler, an unsupported op) leaves the eager profile whole: no compiled grid,
            # which ProfiledCostModel(compiled=True) then names.
            log(f"compiled {kind} not profiled: {type(err).__name__}: {err}")
            doc.setdefault("compile_errors", []).append(f"{kind}: {type(err).__name__}: {err}"[:500])
            if device.type == "cuda":
                torch.cuda.empty_cache()
    _finish_profile_layers(doc, call_f, call_b, single)
    doc["gradient_accumulation_fusion"] = fuse_gradients
    doc["fused_weights"] = {kind: len(weights) for kind, weights in fused.items()}
    tp = None
    if tp_layers and eager:
        tp = dict(config=cfg, microbatch_sizes=microbatch_sizes, seq_lens=seq_lens, recompute=tp_recompute,
                  warmup=warmup, repeats=repeats)
    return _profile_rest(doc, cfg, shape, layers, fused, device, precision, warmup, repeats, overheads, collectives,
                         started, log, tp, fuse_gradients)


def _profile_variant(doc, layers, kind, rc, compiled, compile, fuse_gradients, compile_microbatch_sizes,
                     microbatch_sizes, seq_lens, targets, device, dtype, warmup, repeats, call_f, call_b, single,
                     started, log) -> None:
    """One layer kind's grid (recompute or not, compiled or not) into ``doc``."""
    base, make, run = layers[kind]
    base.to(device)
    module = base
    if compiled and kind == "head":
        run = torch.compile(run, **_compile_options(compile))
    elif compiled:
        module = _compiled(base, compile, fuse_gradients)
    doc["layers"].setdefault(kind, [])
    # The encoder never sees the target: its grid has no target axis.
    with_target = targets if kind != "encoder_block" else None
    sizes = compile_microbatch_sizes if compiled and compile_microbatch_sizes else microbatch_sizes
    axes = [list(sizes), seq_lens] + ([with_target] if with_target else [])
    names = ("forward", "backward", "host_forward", "host_backward", "stored", "peak")
    grid = {q: _nested(axes) for q in names}
    chained = kind not in ("embedding", "head")
    for idx in _indices(axes):
        b, s = axes[0][idx[0]], axes[1][idx[1]]
        t = axes[2][idx[2]] if with_target else (targets[-1] if targets else s)
        smaller_failed = idx[0] > 0 and _get(grid["forward"], (idx[0] - 1, *idx[1:])) is None
        kw = dict(recompute=rc, device=device, dtype=dtype, warmup=warmup, repeats=repeats)
        one = None if smaller_failed else measure(module, make(b, s, t, dtype or torch.float32), run, **kw)
        many = measure(module, make(b, s, t, dtype or torch.float32), run, chain=CHAIN, **kw) if chained and one else None
        consistent = many is not None and all(0 < many[q] - one[q] < (CHAIN - 1) * one[q]
                                              for q in ("forward", "backward"))
        if consistent:
            if not rc:  # samples of the call's fixed cost, eager and compiled apart (key: compiled)
                call_f.append((compiled, many["forward"] - CHAIN * _marginal(one["forward"], many["forward"], CHAIN)))
                call_b.append((compiled, many["backward"] - CHAIN * _marginal(one["backward"], many["backward"], CHAIN)))
            for q in ("forward", "backward", "host_forward", "host_backward"):
                one[q] = _marginal(one[q], many[q], CHAIN)
        else:
            many = None  # a chain slower per layer than a single call, or no faster than it: noise
        for q in names:
            _set(grid[q], idx, None if one is None else one[q])
        if one is not None and many is None:
            single.append((grid, idx))
    entry = {"tp": 1, "recompute": rc, "microbatch_size": axes[0], "seq_len": axes[1],
             "target_len": axes[2] if with_target else None, **grid}
    if compiled:
        entry["compiled"] = True
    doc["layers"][kind].append(entry)
    log(f"profiled {kind} recompute={rc}{' compiled' if compiled else ''} ({time.perf_counter() - started:.1f} s)")
    if compiled and module is not base:
        unfuse_gradient_accumulation(list(module.parameters()))  # the copy's slots, out of the registry
    del module
    base.to("cpu")


def _finish_profile_layers(doc, call_f, call_b, single) -> None:
    # A single timing holds one call's fixed costs besides the layer: T(1) = fixed + marginal, and with the chain
    # T(CHAIN) = fixed + CHAIN * marginal, so fixed = T(CHAIN) - CHAIN * marginal (above).
    def median(samples):
        # The eager blocks' samples (the stage's call is eager code); a compiled-only profile has only compiled ones.
        eager = [v for compiled, v in samples if not compiled]
        return statistics.median(eager or [v for _, v in samples]) if samples else 0.0

    fixed_f, fixed_b = median(call_f), median(call_b)
    for grid, idx in single:
        for q, fixed in (("forward", fixed_f), ("backward", fixed_b)):
            value = _get(grid[q], idx)
            # Where the median call cost is not below this single timing (noise), the timing stands (an
            # overestimate by at most that cost) rather than a layer that costs nothing.
            _set(grid[q], idx, value - fixed if value > fixed else value)
    doc["call_overhead"] = {"forward_seconds": fixed_f, "backward_seconds": fixed_b}


def _profile_rest(doc, cfg, shape, layers, fused, device, precision, warmup, repeats, overheads, collectives, started,
                  log, tp: dict | None = None, fuse_gradients: bool | str = "auto") -> dict:
    """The optimizer, the overheads and the collectives (with ``tp``: and the tensor-parallel layers), after the
    layers."""
    tensors = model_tensors(layers, shape, device)
    implementation = optimizer_implementation(cfg, device)
    if tensors is not None:
        doc["optimizer"] = measure_optimizer(tensors, device, warmup, repeats, implementation)
        del tensors
    else:
        block = layers.get("block", layers.get("encoder_block"))[0]
        doc["optimizer"] = measure_optimizer(block, device, warmup, repeats, implementation)
    log("optimizer measured")
    for weights in fused.values():
        unfuse_gradient_accumulation(weights)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    if overheads:
        try:
            doc["overheads"] = measure_overheads(cfg, shape, device, precision, fuse_gradients=fuse_gradients, log=log)
        except Exception as err:  # noqa: BLE001  the layers' profile stands without it (the terms read as 0)
            log(f"overheads not measured: {type(err).__name__}: {err}")
            doc["overheads"] = {"microbatch_seconds": 0.0, "step_seconds": 0.0, "error": f"{type(err).__name__}: {err}"[:500]}
    if collectives and device.type == "cuda" and torch.cuda.device_count() > 1:
        try:
            data = measure_collectives(torch.cuda.device_count(), tp_layers=tp)
        except Exception as err:  # noqa: BLE001
            if tp is None:
                raise
            # The tensor-parallel layers are a refinement: without them the planner derives tp from tp = 1 (as
            # before), and the collectives' tables are measured on their own.
            log(f"tensor-parallel layers not measured: {type(err).__name__}: {err}")
            doc["tp_layers_error"] = f"{type(err).__name__}: {err}"[:1000]
            tp = None
            data = measure_collectives(torch.cuda.device_count())
        for kind, entries in data.pop("tp_layers", {}).items():
            doc["layers"].setdefault(kind, []).extend(entries)
        doc["collectives"] = data
        log("collectives" + (" and tensor-parallel layers" if tp else "") + " measured")
    doc["seconds"] = round(time.perf_counter() - started, 2)
    return doc


def _compiled(module: nn.Module, mode: bool | str, fused: bool | str) -> nn.Module:
    """A compiled copy of ``module`` as the recipes compile their blocks (``Module.compile``, inductor); the copy's
    fused layers (``fused``: the fusion setting) get gradient slots of their own."""
    import copy

    compiled = copy.deepcopy(module)
    _fuse(compiled, fused)
    compiled.compile(**_compile_options(mode))
    return compiled


def _compile_options(mode: bool | str) -> dict:
    # The recipes' backend (L3D_COMPILE_BACKEND, default inductor: recipes/training.py); a mode only for inductor.
    backend = os.environ.get("L3D_COMPILE_BACKEND", "inductor")
    return {"backend": backend, "mode": (None if mode is True else mode) if backend == "inductor" else None}


def _fuse(module: nn.Module, mode: bool | str) -> list[nn.Parameter]:
    """Gradient-accumulation fusion on the fusable layers of ``module`` that ``gradient_accumulation_fusion=mode``
    fuses, each with an fp32 gradient slot of its own."""
    weights = fuse_gradient_accumulation(choose_fused(fusable_linears(module), mode)[0])
    for w in weights:
        register_slot(w, torch.zeros_like(w), None)
    return weights


#: the tiny models ``measure_overheads`` trains: (LightningModule, data module, their arguments)
_TINY = {
    "gpt": ("lightning_3d.recipes.GPT", "lightning_3d.recipes.data.SyntheticLMDataModule",
            dict(preset_name="tiny", vocab_size=512, seq_length=64, num_layers=1), dict(vocab_size=512, seq_length=64)),
    "t5": ("lightning_3d.recipes.T5", "lightning_3d.recipes.data.SyntheticSeq2SeqDataModule",
           dict(preset_name="tiny", vocab_size=512, num_layers=1, num_decoder_layers=1),
           dict(vocab_size=512, input_length=32, target_length=16)),
}


def _import(path: str):
    import importlib

    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


#: timed steps of each in-situ run (``measure_overheads``)
IN_SITU_STEPS = 10


def measure_overheads(cfg: dict, shape: ModelShape, device: torch.device, precision: str, *, microbatches: int = 4,
                      warmup: int = 3, steps: int = IN_SITU_STEPS, in_situ: bool = True, fuse_gradients: bool | str = "auto",
                      fresh_process: bool = True, log=print) -> dict:
    """The per-micro-batch and per-step seconds a step spends outside the layers and the optimizer's kernels: a
    one-layer model of the same recipe (``_TINY``) trains under ``Compressed3DStrategy`` (one GPU, exact: no
    compression) with 1 and then ``microbatches`` micro-batches of one sample; step(m) = step_s + optimizer_tiny
    + m (microbatch_s + layers_tiny), with the tiny model's layers profiled like the real one's. What it holds:
    Lightning's loop and hooks, the strategy's batch checks and engine, the loss's bookkeeping, each micro-batch's
    forward and backward calls. A few seconds.

    ``in_situ``: also the host's seconds per layer *inside* the training loop (``host_layers``). The same tiny widths
    at the real model's depth train the same way, without and with activation checkpointing: their layers are
    host-bound on a GPU, so each micro-batch's seconds are the host's, and the depth's extra layers cost
    ``(c_depth - c_1)`` per micro-batch. That is more than the same layers' isolated host times (a block timed alone,
    in a tight loop of three), by a factor ``host_scale`` that the isolated timing cannot see (the loop's other
    Python state, the gradient-slot callbacks and hooks of every parameter, an autograd graph the model's depth
    deep); each layer kind's in-situ host time is its tiny isolated host time times that factor (checkpointed
    blocks: their own factor, from the checkpointed run). It depends on the kernels a layer launches, not on its
    widths, so the planner takes it as a floor of the real layers' times at every micro-batch size.

    ``fuse_gradients``: the gradient-accumulation fusion the tiny models train and are profiled with, the profile's
    own (``profile_model`` passes it): a fused layer adds a custom op per linear per micro-batch to the backward, host
    time that the in-situ floor must hold when the step it predicts runs it (and not when it does not).

    ``fresh_process``: the tiny models train in a new Python interpreter (the state of a `lightning-3d fit` run), not
    in this one (False: in this process, a few seconds faster)."""
    if shape.family not in _TINY:
        return {}
    module_path, data_path, model_args, data_args = _TINY[shape.family]
    deep_args = dict(model_args, num_layers=shape.num_layers)
    if shape.family == "t5":
        deep_args["num_decoder_layers"] = shape.num_decoder_layers
    args = (module_path, data_path, model_args, deep_args, data_args, shape.family, device, precision, microbatches,
            warmup, steps, in_situ, fuse_gradients)
    if fresh_process:
        # The loop's host seconds are what the planner predicts for `lightning-3d fit`, a fresh process. Timed inside
        # the profiler's own process, after it has built and timed every layer (its allocator's state, the objects
        # the collector walks), the same tiny models measured above a fresh process's seconds per micro-batch on the
        # same machine (docs/planner.md, "in-situ host times").
        step_s, deep, tails = _tiny_runs_in_fresh_interpreter(args)
    else:
        step_s, deep, tails = _tiny_runs(*args)
    one, many = statistics.median(step_s[1]), statistics.median(step_s[microbatches])
    per_mb = max(0.0, (many - one) / (microbatches - 1))
    # The tiny model's own layers and optimizer, measured as the real model's are, come off those times.
    tiny_cfg = {"trainer": {"precision": precision}, "model": {"class_path": module_path, "init_args": model_args},
                "data": {"init_args": {**data_args}}}
    tiny = profile_model(tiny_cfg, device=device, microbatch_sizes=[1], seq_lens=None,
                         recompute=(False, True) if in_situ else (False,), warmup=2, repeats=5, collectives=False,
                         overheads=False, fuse_gradients=fuse_gradients, log=lambda *a: None)
    tiny_shape = ModelShape(**tiny["model"])
    host = _tiny_cells(tiny, ("host_forward", "host_backward"))
    device_cells = _tiny_cells(tiny, ("forward", "backward"))
    out = {"step_seconds": 0.0, "measured_step_seconds": [one, many], "microbatches": [1, microbatches],
           "model": module_path, "gradient_accumulation_fusion": fuse_gradients,
           "tiny_fused_weights": tiny["fused_weights"]}
    if in_situ:
        out.update(host_layers_in_situ(host, tiny_shape, shape, per_mb, {rc: _per_microbatch(d, microbatches)
                                                                          for rc, d in deep.items()}))
        log(f"in-situ host: scale {out['host_scale']}, per micro-batch {out['host_microbatch_seconds']}")
    # The tiny model's own layers, priced as the planner prices a stage's pass (max of the device's and the host's
    # sums per pass, the blocks' host at its in-situ time), come off its measured micro-batch: what is left is the
    # per-micro-batch cost outside the layers, which the planner adds on top of that max (costs.host).
    tiny_layers = {}
    for kind in tiny_shape.layer_kinds():
        (f, b), (hf, hb) = device_cells[(kind, False)], host[(kind, False)]
        situ = out.get("host_layers", {}).get(kind)
        if situ is not None:
            hf, hb = situ["forward"], situ["backward"]
        tiny_layers[kind] = {"forward": f, "backward": b, "host_forward": hf, "host_backward": hb}
    microbatch_s = microbatch_overhead_from(per_mb, [tiny_layers[k] for k in tiny_shape.layer_kinds()])
    step_only = max(0.0, one - per_mb - tiny["optimizer"]["step_seconds"])
    if in_situ:
        out.update(step_seconds_at_depth(step_only, tiny_shape, shape, tails, tiny["optimizer"]["step_seconds"]))
    log(f"overheads: {microbatch_s * 1e3:.2f} ms per micro-batch, {step_only * 1e3:.2f} ms per step"
        + (f" + {out['step_seconds_per_block'] * 1e3:.3f} ms per block beyond {out['step_blocks']}" if in_situ else ""))
    out.update({"microbatch_seconds": microbatch_s, "step_seconds": step_only, "tiny_layers": tiny_layers,
                "tiny_layers_seconds": sum(tiny_layers[k]["forward"] + tiny_layers[k]["backward"]
                                           for k in tiny_shape.layer_kinds())})
    return out


#: seconds the fresh process of ``measure_overheads`` may take (three short fits of tiny models)
FRESH_PROCESS_TIMEOUT_S = 600


def _tiny_runs_in_fresh_interpreter(args: tuple) -> tuple[dict[int, list[float]], dict[bool, dict[int, list[float]]],
                                                           dict]:
    """``_tiny_runs(*args)`` in a new Python interpreter, killed past ``FRESH_PROCESS_TIMEOUT_S``
    (``subprocess.TimeoutExpired``).

    A new interpreter (``python -c``) rather than a multiprocessing "spawn" worker: spawn re-imports the caller's main
    module in the worker, so a user's script that calls the profiler without an ``if __name__ == "__main__":`` guard
    would run again, profile included, inside it. The caller's ``sys.path`` is handed over (``PYTHONPATH``), so the
    worker imports the same ``lightning_3d`` and recipes; the result comes back as JSON in a file."""
    import subprocess
    import sys

    (module_path, data_path, model_args, deep_args, data_args, family, device, precision, microbatches, warmup, steps,
     in_situ, fuse_gradients) = args
    with tempfile.TemporaryDirectory(prefix="l3d_tiny_") as tmp:
        request, result = Path(tmp) / "request.json", Path(tmp) / "result.json"
        request.write_text(json.dumps([module_path, data_path, model_args, deep_args, data_args, family, str(device),
                                       precision, microbatches, warmup, steps, in_situ, fuse_gradients]))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        code = f"from lightning_3d.planner.profile import _tiny_main; _tiny_main({str(request)!r}, {str(result)!r})"
        proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                              timeout=FRESH_PROCESS_TIMEOUT_S)
        if proc.returncode != 0 or not result.exists():
            raise RuntimeError(f"the tiny models' process exited with {proc.returncode}: {proc.stderr[-1500:]}")
        step_s, deep, tails = json.loads(result.read_text())
    # JSON keys are strings: the micro-batch counts and the checkpointing flags come back as their types.
    return ({int(k): v for k, v in step_s.items()},
            {k == "true": {int(m): v for m, v in runs.items()} for k, runs in deep.items()}, tails)


def _tiny_main(request: str, result: str) -> None:
    """The fresh interpreter's side of ``_tiny_runs_in_fresh_interpreter``."""
    args = json.loads(Path(request).read_text())
    args[6] = torch.device(args[6])
    step_s, deep, tails = _tiny_runs(*args)
    Path(result).write_text(json.dumps([step_s, {"true" if k else "false": v for k, v in deep.items()}, tails]))


def _tiny_runs(module_path: str, data_path: str, model_args: dict, deep_args: dict, data_args: dict, family: str,
               device: torch.device, precision: str, microbatches: int, warmup: int, steps: int, in_situ: bool,
               fuse_gradients: bool | str) -> tuple[dict[int, list[float]], dict[bool, dict[int, list[float]]], dict]:
    """The tiny models' timed steps for ``measure_overheads``: the one-layer model at 1 and ``microbatches``
    micro-batches, and (``in_situ``) the tiny widths at the real depth without and with checkpointing; and the
    steps' tails (``_train_tiny``'s ``tails_out``) of the one-layer model (``tail_seconds``) and of the deep ones
    (``deep_tail_seconds``), with the deep model's optimizer step (``deep_optimizer_seconds``; None without
    ``in_situ``)."""
    import logging

    # Lightning's and the strategy's start-up notes would fill the profiler's output: quiet while the tiny model trains.
    loggers = [logging.getLogger(n) for n in ("lightning.pytorch", "lightning.fabric", "lightning_3d")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    # Lightning sets the rendezvous variables (MASTER_PORT, WORLD_SIZE, ...) in this process's environment: restored,
    # so that processes started after the profile (a benchmark's workers) do not inherit them.
    environ = dict(os.environ)
    deep, deep_optimizer, tails, deep_tails = {}, {}, {}, {}
    try:
        step_s = _train_tiny(module_path, data_path, model_args, data_args, family, device, precision,
                             microbatches, warmup, steps, fuse_gradients, tails_out=tails)
        if in_situ:
            for rc in (False, True):
                # Ten timed steps each: the host's seconds per step vary from step to step (the medians of five
                # differed by tens of per cent between two profiles of the same tiny model on one machine).
                deep[rc] = _train_tiny(module_path, data_path, dict(deep_args, activation_checkpointing=rc), data_args,
                                       family, device, precision, microbatches, 3, IN_SITU_STEPS, fuse_gradients,
                                       optimizer_out=None if rc else deep_optimizer, tails_out=deep_tails)
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)
        os.environ.clear()
        os.environ.update(environ)
    return step_s, deep, {"tail_seconds": [t for m in sorted(tails) for t in tails[m]],
                          "deep_tail_seconds": [t for m in sorted(deep_tails) for t in deep_tails[m]],
                          "deep_optimizer_seconds": deep_optimizer.get("step_seconds")}


def step_seconds_at_depth(step_1: float, tiny: ModelShape, shape: ModelShape, tails: dict,
                          tiny_optimizer: float) -> dict:
    """How the per-step seconds outside the micro-batches and the optimizer's step grow with a rank's blocks.

    After the last backward a step walks every parameter tensor: the non-finite check's norm over all gradients, the
    optimizer step's launches, the strategy's per-parameter bookkeeping. The tails of the tiny models' steps (the
    host's return from the last backward to the step's end, ``_train_tiny``) time that part directly: the one-layer
    model's (``tail_seconds``) and those of the tiny widths at the real depth (``deep_tail_seconds``, as many tensors
    as the real model). Each less its own model's optimizer step, their medians' difference per block beyond the tiny
    model's (``step_blocks``) is ``step_seconds_per_block``; the planner charges a rank ``step_seconds + per_block
    * (its blocks - step_blocks)`` (docs/planner.md, "The step's own seconds grow with depth"). A direct timing, not
    the difference of a one-micro-batch step and the per-micro-batch seconds: those are tens of milliseconds each at
    depth and move by more than this term from one run to the next."""
    blocks = sum(1 for k in shape.layer_kinds() if k not in ("embedding", "head"))
    tiny_blocks = sum(1 for k in tiny.layer_kinds() if k not in ("embedding", "head"))
    out = {"step_seconds_per_block": 0.0, "step_blocks": tiny_blocks, **tails, "tiny_optimizer_seconds": tiny_optimizer}
    if blocks > tiny_blocks and tails.get("tail_seconds") and tails.get("deep_tail_seconds"):
        one = statistics.median(tails["tail_seconds"]) - tiny_optimizer
        deep = statistics.median(tails["deep_tail_seconds"]) - (tails.get("deep_optimizer_seconds") or 0.0)
        out["step_seconds_per_block"] = max(0.0, (deep - one) / (blocks - tiny_blocks))
    out["step_seconds_depth"] = step_1 + out["step_seconds_per_block"] * max(0, blocks - tiny_blocks)
    return out


def _tiny_cells(doc: dict, quantities: tuple[str, str]) -> dict[tuple[str, bool], tuple[float, float]]:
    """(kind, recompute) -> the two quantities at the tiny profile's single grid point."""
    out = {}
    for kind, entries in doc["layers"].items():
        for e in entries:
            cells = []
            for q in quantities:
                v = e[q][0][-1]
                cells.append(float(v[-1] if isinstance(v, list) else v))
            out[(kind, bool(e["recompute"]))] = tuple(cells)
    return out


def _per_microbatch(step_s: dict[int, list[float]], microbatches: int) -> float:
    return max(0.0, (statistics.median(step_s[microbatches]) - statistics.median(step_s[1])) / (microbatches - 1))


def host_layers_in_situ(host: dict[tuple[str, bool], tuple[float, float]], tiny: ModelShape, shape: ModelShape,
                        c_1: float, c_deep: dict[bool, float]) -> dict:
    """Each layer kind's host seconds inside the training loop, from the isolated host times of the tiny model's
    layers (``host``: (kind, recompute) -> (forward, backward)) and the per-micro-batch seconds of the tiny model
    at depth 1 (``c_1``) and at the real model's depth (``c_deep[recompute]``): ``costs.host.in_situ_host_layers``
    solves the depth equations (the scales taken as measured). The isolated times and the block counts are stored
    too (``host_layers_isolated``, ``host_tiny_blocks``), so that a reader re-derives the terms from the seconds."""
    from collections import Counter

    deep = Counter(k for k in shape.layer_kinds() if k not in ("embedding", "head"))
    one = Counter(k for k in tiny.layer_kinds() if k not in ("embedding", "head"))
    isolated = {k: {"forward": host[(k, False)][0], "backward": host[(k, False)][1],
                    "recompute_forward": host[(k, True)][0], "recompute_backward": host[(k, True)][1]} for k in deep}
    layers, scales = in_situ_host_layers(isolated, dict(one), dict(deep), c_1, c_deep[False], c_deep[True])
    return {"host_layers": layers, "host_scale": scales, "host_layers_isolated": isolated,
            "host_tiny_blocks": dict(one),
            "host_microbatch_seconds": {"depth_1": c_1, "depth": c_deep[False], "depth_recompute": c_deep[True]}}


def _train_tiny(module_path: str, data_path: str, model_args: dict, data_args: dict, family: str, device: torch.device,
                precision: str, microbatches: int, warmup: int, steps: int,
                fuse_gradients: bool | str = "auto", samples: int = 1,
                optimizer_out: dict | None = None, tails_out: dict | None = None) -> dict[int, list[float]]:
    """Seconds of each timed step (GPU-synchronised batch start to end) of the tiny model, per micro-batch count
    (1 and ``microbatches``, each of ``samples`` sequences). ``optimizer_out``: filled with ``measure_optimizer``'s
    timing of the trained model's parameters (the recipes' AdamW implementation on ``device``). ``tails_out``: per
    micro-batch count, each timed step's tail, from the host's return from its last backward (Lightning's
    ``on_after_backward``, which the strategy calls once, after the engine has run every micro-batch) to the step's
    GPU-synchronised end: the non-finite check, the optimizer step, the loop's and the strategy's per-step work (and
    whatever backward work the GPU still had queued, little at tiny widths, whose steps are host-bound)."""
    import lightning.pytorch as pl

    step_s: dict[int, list[float]] = {}

    class Timer(pl.Callback):
        def __init__(self, m: int) -> None:
            self.m, self.t0 = m, 0.0

        def on_train_batch_start(self, trainer, module, batch, idx) -> None:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            self.t0 = time.perf_counter()
            self.backward_done = None

        def on_after_backward(self, trainer, module) -> None:
            self.backward_done = time.perf_counter()

        def on_train_batch_end(self, trainer, module, out, batch, idx) -> None:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if trainer.global_step > warmup:
                end = time.perf_counter()
                step_s.setdefault(self.m, []).append(end - self.t0)
                if tails_out is not None and self.backward_done is not None:
                    tails_out.setdefault(self.m, []).append(end - self.backward_done)

    accelerator = "gpu" if device.type == "cuda" else "cpu"
    # On a CPU the tiny model's values turn subnormal within a few steps, and subnormal arithmetic is many times
    # slower there (not on GPUs): flushed to zero while it trains, so the steps time the overheads, not that.
    flushed = device.type == "cpu" and torch.set_flush_denormal(True)
    try:
        _fit_tiny(module_path, data_path, model_args, data_args, family, device, accelerator, precision, microbatches,
                  warmup, steps, Timer, fuse_gradients, samples, optimizer_out)
    finally:
        if flushed:
            torch.set_flush_denormal(False)
    return step_s


def _fit_tiny(module_path, data_path, model_args, data_args, family, device, accelerator, precision, microbatches,
              warmup, steps, Timer, fuse_gradients="auto", samples=1, optimizer_out=None) -> None:
    import lightning.pytorch as pl

    from lightning_3d.strategies.compressed_3d import Compressed3DStrategy

    with tempfile.TemporaryDirectory() as tmp:
        for m in (1, microbatches):
            torch.manual_seed(0)
            data = _import(data_path)(batch_size=m * samples, num_samples=m * samples * (warmup + steps + 1), **data_args)
            ids = {k: getattr(data, k) for k in ("pad_token_id", "eos_token_id")} if family == "t5" else {}
            model = _import(module_path)(**model_args, **ids)
            trainer = pl.Trainer(accelerator=accelerator, devices=[device.index or 0] if accelerator == "gpu" else 1,
                                 strategy=Compressed3DStrategy(num_microbatches=m, compression=False,
                                                               gradient_accumulation_fusion=fuse_gradients),
                                 precision=precision if accelerator == "gpu" else "32-true", max_steps=warmup + steps,
                                 logger=False, enable_checkpointing=False, enable_progress_bar=False,
                                 enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
                                 default_root_dir=tmp, callbacks=[Timer(m)])
            trainer.fit(model, datamodule=data)
            if optimizer_out is not None and m == microbatches:
                optimizer_out.update(measure_optimizer(model, device, 2, 5, optimizer_implementation({}, device)))
            del trainer, model, data
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


class _NoCost:
    source = "none"


def _known(name: str) -> bool:
    try:
        device_spec(name)
        return True
    except ValueError:
        return False


def _default_lengths(n: int) -> list[int]:
    out = [x for x in (128, 256, 512, 1024, 2048, 4096) if x < n]
    return out[-3:] + [n]


def _nested(axes):
    if len(axes) == 1:
        return [None] * len(axes[0])
    return [_nested(axes[1:]) for _ in axes[0]]


def _indices(axes):
    import itertools

    return itertools.product(*(range(len(a)) for a in axes))


def _get(grid, idx):
    for i in idx:
        grid = grid[i]
    return grid


def _set(grid, idx, value):
    for i in idx[:-1]:
        grid = grid[i]
    grid[idx[-1]] = value


def _collective_worker(rank: int, world: int, path: str, sizes: list[int], tp: dict | None = None,
                       backend: str = "nccl") -> None:
    """One rank of the multi-GPU measurements: the collectives' tables (``sizes``: bytes; none when empty) and, with
    ``tp``, the recipe's tensor-parallel layers (``_tp_layer_grids``); rank 0 writes the JSON to ``path``."""
    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, rank=rank, world_size=world)
    out: dict = {}
    try:
        if sizes:
            out.update(_collective_tables(rank, world, sizes))
        if tp:
            out["tp_layers"] = _tp_layer_grids(rank, world, tp)
        if rank == 0:
            Path(path).write_text(json.dumps(out))
    finally:
        dist.destroy_process_group()


def _collective_tables(rank: int, world: int, sizes: list[int]) -> dict:
    import torch.distributed as dist

    out: dict = {"all_reduce": {}, "all_gather": {}, "reduce_scatter": {}, "p2p": []}
    groups = {}
    n = 2
    while n <= world:
        groups[n] = dist.new_group(list(range(n)))
        n *= 2
    for n, group in groups.items():
        for name in ("all_reduce", "all_gather", "reduce_scatter"):
            rows = []
            for size in sizes:
                x = torch.empty(size // 2, dtype=torch.bfloat16, device="cuda")
                outs = torch.empty(size // 2 * n, dtype=torch.bfloat16, device="cuda") if name == "all_gather" else None
                small = torch.empty(size // 2 // n, dtype=torch.bfloat16, device="cuda")

                def op():
                    if name == "all_reduce":
                        dist.all_reduce(x, group=group)
                    elif name == "all_gather":
                        dist.all_gather_into_tensor(outs, x, group=group)
                    else:
                        dist.reduce_scatter_tensor(small, x, group=group)

                rows.append([size, _time_op(op, rank < n)])
            if rank == 0:
                out[name][str(n)] = rows
    for size in sizes:
        x = torch.empty(size // 2, dtype=torch.bfloat16, device="cuda")

        def p2p():
            if rank == 0:
                dist.send(x, 1)
            elif rank == 1:
                dist.recv(x, 0)

        out["p2p"].append([size, _time_op(p2p, rank < 2)])
    return out


def _tp_layer_grids(rank: int, world: int, spec: dict) -> dict:
    """Per tensor-parallel degree n in ``spec["sizes"]`` (ranks 0..n-1 take part, the others wait): the grids of each
    layer kind the recipe shards (``RecipeCosts.tensor_parallel``), measured as ``_profile_variant`` measures tp = 1
    (a chain of ``CHAIN`` for the per-layer time, the host's seconds beside the span), with the shard's own compute,
    its collectives inside the span and their launches in the host time: what a derived grid cannot know.
    ``{kind: [entry, ...]}``, entries marked ``"collectives": true``."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    cfg = spec["config"]
    model = cfg.get("model") or {}
    path = model.get("class_path", "lightning_3d.recipes.GPT")
    _import(path)  # a fresh process: importing the recipe registers its costs (the planner may not import recipes)
    recipe = recipe_costs(path)
    device = torch.device("cuda", rank) if spec["device"] == "cuda" else torch.device("cpu")
    dtype = torch.bfloat16 if spec.get("bf16") and device.type == "cuda" else None
    shape = ModelShape(**spec["shape"])
    seq_lens, sizes = list(spec["seq_lens"]), list(spec["microbatch_sizes"])
    out: dict[str, list] = {}
    for n in spec["tp_sizes"]:
        group = dist.new_group(list(range(n)))  # every rank creates every group
        if rank < n:
            mesh = DeviceMesh.from_group(group, device.type)
            torch.manual_seed(0)
            layers = recipe.layers(dict(model.get("init_args") or {}), dict((cfg.get("data") or {}).get("init_args")
                                                                            or {}), shape, device)
            for kind, (module, make, run) in layers.items():
                module.to(device)
                if not recipe.tensor_parallel(kind, module, mesh):
                    continue
                for rc in spec["recompute"]:
                    axes = [sizes, seq_lens]
                    names = ("forward", "backward", "host_forward", "host_backward", "stored", "peak")
                    grid = {q: _nested(axes) for q in names}
                    fixed: dict[str, list[float]] = {"forward": [], "backward": []}  # a call's fixed cost, per chain
                    single = []  # grid points whose chain was noise: their T(1) holds that fixed cost
                    for idx in _indices(axes):
                        b, s = axes[0][idx[0]], axes[1][idx[1]]
                        kw = dict(recompute=rc, device=device, dtype=dtype, warmup=spec["warmup"],
                                  repeats=spec["repeats"])
                        one = measure(module, make(b, s, s, dtype or torch.float32), run, **kw)
                        many = (measure(module, make(b, s, s, dtype or torch.float32), run, chain=CHAIN, **kw)
                                if one else None)
                        if many is not None and all(0 < many[q] - one[q] < (CHAIN - 1) * one[q]
                                                    for q in ("forward", "backward")):
                            for q in ("forward", "backward"):
                                fixed[q].append(many[q] - CHAIN * _marginal(one[q], many[q], CHAIN))
                            for q in ("forward", "backward", "host_forward", "host_backward"):
                                one[q] = _marginal(one[q], many[q], CHAIN)
                        elif one is not None:
                            single.append(idx)
                        for q in names:
                            _set(grid[q], idx, None if one is None else one[q])
                    _subtract_fixed(grid, single, fixed)
                    out.setdefault(kind, []).append({"tp": n, "recompute": rc, "microbatch_size": sizes,
                                                     "seq_len": seq_lens, "target_len": None, "collectives": True,
                                                     **grid})
            del layers
            if device.type == "cuda":
                torch.cuda.empty_cache()
        dist.barrier()
    return out


def _subtract_fixed(grid: dict, single: list[tuple], fixed: dict[str, list[float]]) -> None:
    """As at tp = 1 (``_finish_profile_layers``): each single timing (grid points ``single``, whose chain was noise)
    less the median of the call's fixed costs ``fixed[q]`` that the consistent chains gave, where it is above it
    (else the timing stands: an overestimate by at most that cost)."""
    for q in ("forward", "backward"):
        cost = statistics.median(fixed[q]) if fixed[q] else 0.0
        for idx in single:
            value = _get(grid[q], idx)
            _set(grid[q], idx, value - cost if value > cost else value)


def tp_degrees(shape: ModelShape, world: int) -> list[int]:
    """The tensor-parallel degrees the profiler measures on ``world`` GPUs: powers of two up to it that divide the
    heads and the hidden size (what the planner's skeletons allow within a node)."""
    out, n = [], 2
    while n <= world:
        if shape.num_heads % n == 0 and shape.hidden_size % n == 0:
            out.append(n)
        n *= 2
    return out


def measure_tp_layers(config: str | Path | dict, world: int, *, device: str = "cuda", microbatch_sizes=(1, 2, 4),
                      seq_lens=None, recompute=(False,), warmup: int = 2, repeats: int = 5,
                      collective_sizes=(), timeout_s: float = 240.0) -> dict:
    """``world`` processes (NCCL on GPUs, gloo on the CPU for tests): the recipe's tensor-parallel layers at every
    degree of ``tp_degrees`` (``_tp_layer_grids``), and the collectives' tables when ``collective_sizes`` is given.
    Returns ``{"tp_layers": {kind: [entry]}, ...tables}``; past ``timeout_s`` the processes are stopped and a
    TimeoutError raised."""
    cfg = load_config(config)
    w = workload_from_config(cfg, ClusterSpec.single_node(1), cost_model=_NoCost())
    precision = str((cfg.get("trainer") or {}).get("precision", "32-true"))
    spec = {"config": cfg, "shape": asdict(w.shape), "device": device, "bf16": BYTES.get(precision, 4) == 2,
            "tp_sizes": tp_degrees(w.shape, world), "microbatch_sizes": sorted(set(microbatch_sizes)),
            "seq_lens": sorted(set(seq_lens or [w.seq_len])), "recompute": list(recompute), "warmup": warmup,
            "repeats": repeats}
    recipe = recipe_costs(((cfg.get("model") or {}).get("class_path")) or "lightning_3d.recipes.GPT")
    if recipe.tensor_parallel is None or recipe.layers is None:
        spec["tp_sizes"] = []  # a recipe that registers no tensor-parallel plan for its layers: derived grids
    if not spec["tp_sizes"] and not collective_sizes:
        return {"tp_layers": {}}
    os.environ["MASTER_PORT"] = str(_free_port())
    for key, value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
        os.environ.setdefault(key, value)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "multi.json")
        _spawn(_collective_worker, (world, path, list(collective_sizes), spec if spec["tp_sizes"] else None,
                                    "nccl" if device == "cuda" else "gloo"), world, timeout_s)
        return json.loads(Path(path).read_text())


def _spawn(fn, args: tuple, world: int, timeout_s: float) -> None:
    """``mp.spawn`` with a deadline: a worker's error is raised as spawn raises it; past ``timeout_s`` (a rank stuck
    in a collective) the workers are killed and a TimeoutError raised, so that the profile goes on without them."""
    import torch.multiprocessing as mp

    context = mp.spawn(fn, args=args, nprocs=world, join=False)
    deadline = time.monotonic() + timeout_s
    while not context.join(timeout=min(2.0, max(0.05, deadline - time.monotonic()))):
        if time.monotonic() > deadline:
            for proc in context.processes:
                if proc.is_alive():
                    proc.kill()
            for proc in context.processes:
                proc.join()
            raise TimeoutError(f"the {world} measuring processes did not finish within {timeout_s:.0f} s")


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _time_op(op, member: bool, repeats: int = 5) -> float:
    import torch.distributed as dist

    times = []
    for i in range(repeats + 2):
        dist.barrier()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        if member:
            op()
        torch.cuda.synchronize()
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_collectives(world: int, sizes=(2**20, 2**23, 2**26, 2**28), *, tp_layers: dict | None = None) -> dict:
    """All-reduce / all-gather / reduce-scatter (groups of 2, 4, ... GPUs) and GPU0→GPU1 send times by bytes; with
    ``tp_layers`` (``measure_tp_layers``' keyword arguments) also the recipe's tensor-parallel layers, in the same
    processes (key ``tp_layers``)."""
    if tp_layers is not None:
        data = measure_tp_layers(world=world, device="cuda", collective_sizes=sizes, **tp_layers)
    else:
        import torch.multiprocessing as mp

        os.environ["MASTER_PORT"] = str(_free_port())
        # NVLink multicast (NVLS) off, as the benchmarks run NCCL: it is unavailable or unstable on shared machines.
        for key, value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                           ("NVSHMEM_DISABLE_NVLS", "1")):
            os.environ.setdefault(key, value)
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "collectives.json")
            mp.spawn(_collective_worker, args=(world, path, list(sizes)), nprocs=world, join=True)
            data = json.loads(Path(path).read_text())
    # Bus bandwidth of the largest all-reduce over all GPUs: what ClusterSpec.intra_node_bandwidth means.
    biggest = max((int(n) for n in data["all_reduce"]), default=0)
    if biggest:
        size, seconds = data["all_reduce"][str(biggest)][-1]
        data["intra_node_bandwidth"] = 2 * (biggest - 1) / biggest * size / seconds
    return data


def profile_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="lightning-3d profile", description="measure per-layer time and memory on"
                                     " this GPU (and collectives between its GPUs); write a profile for `lightning-3d plan`")
    parser.add_argument("--config", required=True, help="training YAML (or packaged config name) whose model to profile")
    parser.add_argument("--out", default=None, help="profile file (default: <config name>.profile.json)")
    parser.add_argument("--device", default=None, help="default: the current GPU; 'cpu' only for tests")
    parser.add_argument("--microbatch-sizes", default="1,2,4,8")
    parser.add_argument("--seq-lens", default=None, help="comma-separated (default: up to the config's length)")
    parser.add_argument("--target-lens", default=None, help="T5 decoder lengths, comma-separated")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-recompute", action="store_true", help="skip the activation-checkpointing grid")
    parser.add_argument("--no-collectives", action="store_true")
    parser.add_argument("--compile", action="store_true", help="also profile the blocks under torch.compile (for"
                        " plans of compiled models: ProfiledCostModel(compiled=True))")
    parser.add_argument("--no-overheads", action="store_true", help="skip the per-step / per-micro-batch overheads"
                        " (a few steps of a tiny model under the strategy)")
    parser.add_argument("--gradient-accumulation-fusion", default="auto", choices=("auto", "true", "false"),
                        help="the layers as Compressed3DStrategy(gradient_accumulation_fusion=...) trains them"
                        " (default: auto, the strategy's default)")
    ns = parser.parse_args(argv)

    def ints(text):
        try:
            return [int(x) for x in text.split(",")] if text else None
        except ValueError:
            parser.error(f"expected comma-separated integers, got {text!r}")

    try:
        doc = profile_model(ns.config, device=ns.device, microbatch_sizes=ints(ns.microbatch_sizes), seq_lens=ints(ns.seq_lens),
                            target_lens=ints(ns.target_lens), recompute=(False,) if ns.no_recompute else (False, True),
                            warmup=ns.warmup, repeats=ns.repeats, collectives=not ns.no_collectives, compile=ns.compile,
                            overheads=not ns.no_overheads,
                            fuse_gradients={"auto": "auto", "true": True, "false": False}[ns.gradient_accumulation_fusion])
    except (RuntimeError, ValueError, FileNotFoundError) as err:
        parser.error(str(err))
    out = Path(ns.out or f"{Path(str(ns.config)).stem}.profile.json")
    out.write_text(json.dumps(doc, allow_nan=False))
    print(f"wrote {out} ({doc['seconds']} s)")
    return 0



