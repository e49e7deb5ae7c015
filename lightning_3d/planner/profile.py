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

import os
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_3d.costs import ClusterSpec, DeviceSpec, ModelShape, device_spec, new_profile, recipe_costs
from lightning_3d.planner.api import BYTES, load_config, workload_from_config


class _Timer:
    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def span(self, fn):
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = fn()
            end.record()
            return out, (start, end)
        t0 = time.perf_counter()
        out = fn()
        return out, time.perf_counter() - t0

    def seconds(self, mark) -> float:
        if self.cuda:
            return mark[0].elapsed_time(mark[1]) / 1e3
        return mark


def measure(module: nn.Module, inputs: tuple, run, *, recompute: bool, device: torch.device, dtype: torch.dtype | None,
            warmup: int, repeats: int) -> tuple[float, float, float, float] | None:
    """(forward s, backward s, stored bytes, peak bytes) medians, or None when the shape runs out of memory."""
    timer = _Timer(device)
    cuda = device.type == "cuda"
    fwd_t, bwd_t, stored, peak = [], [], [], []

    def forward():
        with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
            if recompute:
                return checkpoint(run, module, *inputs, use_reentrant=False)
            return run(module, *inputs)

    try:
        for i in range(warmup + repeats):
            for p in module.parameters():
                p.grad = None
            for x in inputs:
                if isinstance(x, torch.Tensor) and x.requires_grad:
                    x.grad = None
            if cuda:
                torch.cuda.synchronize(device)
                torch.cuda.reset_peak_memory_stats(device)
                base = torch.cuda.memory_allocated(device)
            out, f_mark = timer.span(forward)
            if cuda:
                after = torch.cuda.memory_allocated(device)
            grad = torch.ones_like(out) if out.dim() == 0 else torch.randn_like(out)
            _, b_mark = timer.span(lambda: out.backward(grad))
            if cuda:
                torch.cuda.synchronize(device)
                top = torch.cuda.max_memory_allocated(device)
            if i >= warmup:
                fwd_t.append(timer.seconds(f_mark))
                bwd_t.append(timer.seconds(b_mark))
                if cuda:
                    # Kept for the backward: what the forward left allocated, its output included (the next layer
                    # keeps it as its input, which was allocated before this layer's baseline: each tensor between
                    # layers is counted once, by its producer); and the transient on top while forward and backward ran.
                    stored.append(max(0, after - base))
                    peak.append(max(0, top - after))
            del out, grad
    except torch.OutOfMemoryError:
        if cuda:
            torch.cuda.empty_cache()
        return None
    med = statistics.median
    return med(fwd_t), med(bwd_t), float(med(stored)) if stored else 0.0, float(med(peak)) if peak else 0.0


def measure_optimizer(module: nn.Module, device: torch.device, warmup: int, repeats: int) -> dict:
    """Seconds per parameter of an AdamW step as the recipes run it (fp32 state, torch's default implementation)."""
    module.to(device)
    params = [p for p in module.parameters()]
    for p in params:
        p.grad = torch.randn_like(p)
    optimizer = torch.optim.AdamW(params, lr=1e-4)
    timer = _Timer(device)
    times = []
    for i in range(warmup + repeats):
        _, mark = timer.span(optimizer.step)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i >= warmup:
            times.append(timer.seconds(mark))
    count = sum(p.numel() for p in params)
    module.to("cpu")
    for p in params:
        p.grad = None
    return {"seconds_per_parameter": statistics.median(times) / count, "optimizer": "torch.optim.AdamW"}


def profile_model(config: str | Path | dict, *, device: str | torch.device | None = None, microbatch_sizes=(1, 2, 4, 8),
                  seq_lens=None, target_lens=None, recompute=(False, True), warmup: int = 2, repeats: int = 5,
                  collectives: bool = True, log=print) -> dict:
    """The profile document of the config's model on ``device`` (default: the current GPU; CPU only if named)."""
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
    for kind, (module, make, run) in layers.items():
        module.to(device)
        doc["layers"][kind] = []
        for rc in (recompute if kind not in ("embedding", "head") else (False,)):
            # The encoder never sees the target: its grid has no target axis.
            with_target = targets if kind != "encoder_block" else None
            axes = [list(microbatch_sizes), seq_lens] + ([with_target] if with_target else [])
            grid = {q: _nested(axes) for q in ("forward", "backward", "stored", "peak")}
            for idx in _indices(axes):
                b, s = axes[0][idx[0]], axes[1][idx[1]]
                t = axes[2][idx[2]] if with_target else (targets[-1] if targets else s)
                smaller_failed = idx[0] > 0 and _get(grid["forward"], (idx[0] - 1, *idx[1:])) is None
                result = None if smaller_failed else measure(
                    module, make(b, s, t, dtype or torch.float32), run, recompute=rc, device=device, dtype=dtype,
                    warmup=warmup, repeats=repeats)
                for q, value in zip(("forward", "backward", "stored", "peak"), result or (None,) * 4):
                    _set(grid[q], idx, value)
            entry = {"tp": 1, "recompute": rc, "microbatch_size": axes[0], "seq_len": axes[1],
                     "target_len": axes[2] if with_target else None, **grid}
            doc["layers"][kind].append(entry)
            log(f"profiled {kind} recompute={rc} ({time.perf_counter() - started:.1f} s)")
        module.to("cpu")
    block = layers.get("block", layers.get("encoder_block"))[0]
    doc["optimizer"] = measure_optimizer(block, device, warmup, repeats)
    if collectives and device.type == "cuda" and torch.cuda.device_count() > 1:
        doc["collectives"] = measure_collectives(torch.cuda.device_count())
    doc["seconds"] = round(time.perf_counter() - started, 2)
    return doc


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


def _collective_worker(rank: int, world: int, path: str, sizes: list[int]) -> None:
    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world)
    out: dict = {"all_reduce": {}, "all_gather": {}, "reduce_scatter": {}, "p2p": []}
    try:
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
        if rank == 0:
            Path(path).write_text(json.dumps(out))
    finally:
        dist.destroy_process_group()


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


def measure_collectives(world: int, sizes=(2**20, 2**23, 2**26, 2**28)) -> dict:
    """All-reduce / all-gather / reduce-scatter (groups of 2, 4, ... GPUs) and GPU0→GPU1 send times by bytes."""
    import torch.multiprocessing as mp

    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    # NVLink multicast (NVLS) off, as the benchmarks run NCCL: it is unavailable or unstable on shared machines.
    for key, value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
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
    ns = parser.parse_args(argv)

    def ints(text):
        try:
            return [int(x) for x in text.split(",")] if text else None
        except ValueError:
            parser.error(f"expected comma-separated integers, got {text!r}")

    try:
        doc = profile_model(ns.config, device=ns.device, microbatch_sizes=ints(ns.microbatch_sizes), seq_lens=ints(ns.seq_lens),
                            target_lens=ints(ns.target_lens), recompute=(False,) if ns.no_recompute else (False, True),
                            warmup=ns.warmup, repeats=ns.repeats, collectives=not ns.no_collectives)
    except (RuntimeError, ValueError, FileNotFoundError) as err:
        parser.error(str(err))
    out = Path(ns.out or f"{Path(str(ns.config)).stem}.profile.json")
    out.write_text(json.dumps(doc, allow_nan=False))
    print(f"wrote {out} ({doc['seconds']} s)")
    return 0



