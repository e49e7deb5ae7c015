"""Measurements across the machine's GPUs, in spawned processes: the collectives' tables (all-reduce, all-gather,
reduce-scatter by group size and bytes; point-to-point) and the recipe's tensor-parallel layers at each degree, timed
with their collectives inside the span (grids marked ``"collectives": true``, which the planner reads instead of
deriving them from tp = 1; docs/planner.md). NCCL on GPUs, gloo on the CPU for tests; a deadline stops stuck workers.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import torch

from lightning_3d.costs import ClusterSpec, ModelShape, recipe_costs
from lightning_3d.planner.api import BYTES, load_config, workload_from_config
from lightning_3d.planner.layers import NoCost, precision_of
from lightning_3d.planner.timing import QUANTITIES, grid_indices, grid_set, nested, subtract_fixed, time_point

#: NVLink multicast (NVLS) off, as the benchmarks run NCCL: it is unavailable or unstable on shared machines
NO_MULTICAST = (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1"))


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
    """Per tensor-parallel degree n in ``spec["tp_sizes"]`` (ranks 0..n-1 take part, the others wait): the grids of
    each layer kind the recipe shards (``RecipeCosts.tensor_parallel``), measured as ``planner.layers`` measures
    tp = 1 (``timing.time_point``: a chain of ``CHAIN`` for the per-layer time, the host's seconds beside the span),
    with the shard's own compute, its collectives inside the span and their launches in the host time: what a derived
    grid cannot know. ``spec["recipe"]``: the registered entry, pickled to this process (unpickling it imported the
    recipe's module, which registered it here too). ``{kind: [entry, ...]}``, entries marked ``"collectives": true``."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    cfg, recipe = spec["config"], spec["recipe"]
    model = cfg.get("model") or {}
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
                    out.setdefault(kind, []).append(_tp_grid(module, make, run, rc, sizes, seq_lens, device, dtype,
                                                             spec, n))
            del layers
            if device.type == "cuda":
                torch.cuda.empty_cache()
        dist.barrier()
    return out


def _tp_grid(module, make, run, rc: bool, sizes: list[int], seq_lens: list[int], device: torch.device, dtype,
             spec: dict, n: int) -> dict:
    """One sharded layer's grid entry at degree ``n`` (recompute ``rc``): single timings whose chain was noise less
    the median fixed cost of the consistent chains (``timing.subtract_fixed``), as at tp = 1."""
    axes = [sizes, seq_lens]
    grid = {q: nested(axes) for q in QUANTITIES}
    fixed: dict[str, list[float]] = {"forward": [], "backward": []}  # a call's fixed cost, per chain
    single = []  # grid points whose chain was noise: their T(1) holds that fixed cost
    kw = dict(recompute=rc, device=device, dtype=dtype, warmup=spec["warmup"], repeats=spec["repeats"])
    for idx in grid_indices(axes):
        b, s = axes[0][idx[0]], axes[1][idx[1]]
        one, cost = time_point(module, lambda: make(b, s, s, dtype or torch.float32), run, chained=True, **kw)
        if cost is not None:
            fixed["forward"].append(cost[0])
            fixed["backward"].append(cost[1])
        elif one is not None:
            single.append(idx)
        for q in QUANTITIES:
            grid_set(grid[q], idx, None if one is None else one[q])
    subtract_fixed(grid, single, fixed)
    return {"tp": n, "recompute": rc, "microbatch_size": sizes, "seq_len": seq_lens, "target_len": None,
            "collectives": True, **grid}


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
    w = workload_from_config(cfg, ClusterSpec.single_node(1), cost_model=NoCost())
    recipe = recipe_costs(((cfg.get("model") or {}).get("class_path")) or "lightning_3d.recipes.GPT")
    spec = {"config": cfg, "recipe": recipe, "shape": asdict(w.shape), "device": device,
            "bf16": BYTES.get(precision_of(cfg), 4) == 2, "tp_sizes": tp_degrees(w.shape, world),
            "microbatch_sizes": sorted(set(microbatch_sizes)), "seq_lens": sorted(set(seq_lens or [w.seq_len])),
            "recompute": list(recompute), "warmup": warmup, "repeats": repeats}
    if recipe.tensor_parallel is None or recipe.layers is None:
        spec["tp_sizes"] = []  # a recipe that registers no tensor-parallel plan for its layers: derived grids
    if not spec["tp_sizes"] and not collective_sizes:
        return {"tp_layers": {}}
    os.environ["MASTER_PORT"] = str(_free_port())
    for key, value in NO_MULTICAST:
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
        for key, value in NO_MULTICAST:
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
