"""``lightning_3d.planner.plan(...)`` and ``lightning-3d plan``: read a training config, search, and write a config
that ``lightning-3d fit --config PLAN.yaml`` runs unchanged (the input with its strategy, devices, micro-batching
and checkpointing replaced), with the prediction in a comment. Every emitted strategy section is checked by
constructing ``Compressed3DStrategy(**init_args)`` (the strategy's own validation) before it is written, in the
strategy's grouped form (``parallelism``, ``pipeline``, ``compression``, ``runtime``).

Configs are read with ``yaml.safe_load``; the model is recognised by its class path among the recipes registered
with ``lightning_3d.costs.register_recipe`` (``import lightning_3d.recipes`` registers GPT and T5; the CLI does it).
No class from the file is imported or instantiated.
"""

from __future__ import annotations

import argparse
import copy
import json
from dataclasses import dataclass, fields
from pathlib import Path

import yaml

from lightning_3d.costs import AnalyticCostModel, ClusterSpec, CostModel, ProfiledCostModel, recipe_costs
from lightning_3d.planner.model import Prediction, Workload
from lightning_3d.planner.search import SearchOptions, SearchResult, search
from lightning_3d.strategies.compressed_3d import Compressed3DStrategy
from lightning_3d.strategies.config import PipelineConfig, flatten_options, nest_options

BYTES = {"bf16-mixed": 2, "16-mixed": 2, "bf16-true": 2, "16-true": 2, "32-true": 4, "32": 4, "bf16": 2}


def strategy_options(cfg: dict) -> dict:
    """The strategy's options in a training config by flat name, from its grouped or flat ``init_args``."""
    strategy = (cfg.get("trainer") or {}).get("strategy")
    init = (strategy.get("init_args") or {}) if isinstance(strategy, dict) else {}
    return flatten_options(init)


def strategy_supports_stage_checkpointing() -> bool:
    return "stage_activation_checkpointing" in {f.name for f in fields(PipelineConfig)}


@dataclass
class Plan:
    """The search's outcome: ``configs[i]`` (dicts, the YAML's content) matches ``predictions[i]``; ``yaml(i)`` is
    the text ``lightning-3d plan`` writes."""

    configs: list[dict]
    predictions: list[Prediction]
    result: SearchResult
    num_gpus: int
    cluster: ClusterSpec

    @property
    def best(self) -> dict:
        return self.configs[0]

    def yaml(self, index: int = 0) -> str:
        p = self.predictions[index]
        s = p.summary()
        header = [
            "# Written by `lightning-3d plan` (lightning_3d.planner); run it with `lightning-3d fit --config THIS_FILE`.",
            f"# Prediction ({s['costs']}): step {s['step_time_s'] * 1e3:.1f} ms ({s['tokens_per_s']:.0f} tokens/s),"
            f" peak memory {s['peak_memory_gib']:.2f} GiB of {s['memory_budget_gib']:.2f} GiB usable per GPU",
            f"#   pipeline {s['pipeline_s'] * 1e3:.1f} ms + exposed dp all-reduce {s['exposed_dp_allreduce_s'] * 1e3:.1f} ms"
            f" + optimizer {s['optimizer_s'] * 1e3:.1f} ms + loop {s['step_overhead_s'] * 1e3:.1f} ms; {self.num_gpus} GPUs"
            f" ({self.cluster.nodes} node(s) x {self.cluster.gpus_per_node} {self.cluster.device.name})",
            f"#   rank {index + 1} of {len(self.predictions)}; search: {self.result.skeletons} layouts,"
            f" {self.result.evaluated} candidates in {self.result.seconds:.2f} s"
            + (" (time budget reached)" if self.result.truncated else ""),
            "# prediction: " + json.dumps(s),
        ]
        return "\n".join(header) + "\n" + yaml.safe_dump(self.configs[index], sort_keys=False)


def load_config(config: str | Path | dict) -> dict:
    if isinstance(config, dict):
        return copy.deepcopy(config)
    path = Path(config)
    if not path.is_file():
        from importlib import resources

        packaged = resources.files("lightning_3d.recipes").joinpath("configs", f"{str(config).removesuffix('.yaml')}.yaml")
        if not packaged.is_file():
            raise FileNotFoundError(f"--config {config!r} is neither a file nor a packaged config name.")
        path = Path(str(packaged))
    data = yaml.safe_load(path.read_text())
    if not isinstance(data, dict) or "model" not in data:
        raise ValueError(f"{config}: a training config with a 'model' section is expected (see lightning_3d/recipes/configs).")
    return data


def workload_from_config(cfg: dict, cluster: ClusterSpec, cost_model: CostModel | None = None,
                         global_batch_size: int | None = None) -> Workload:
    """The model shape, lengths and global batch of a training config (GPT or T5 recipe)."""
    model = cfg.get("model") or {}
    path = model.get("class_path", "lightning_3d.recipes.GPT")
    args = dict(model.get("init_args") or {})
    data = dict((cfg.get("data") or {}).get("init_args") or {})
    precision = str((cfg.get("trainer") or {}).get("precision", "32-true"))
    shape, seq, target = recipe_costs(path).workload(args, data, BYTES.get(precision, 2))
    if global_batch_size is None:
        init = strategy_options(cfg)
        dp = init.get("data_parallel_size", "auto")
        if not isinstance(dp, int):
            trainer = cfg.get("trainer") or {}
            devices = trainer.get("devices", 1)
            devices = devices if isinstance(devices, int) else 1
            world = devices * int(trainer.get("num_nodes", 1))
            dp = max(1, world // (int(init.get("pipeline_parallel_size", 1)) * int(init.get("tensor_parallel_size", 1))))
        global_batch_size = int(data.get("batch_size", 8)) * dp
    cost = cost_model if cost_model is not None else AnalyticCostModel(shape, cluster.device)
    return Workload(shape, seq, global_batch_size, cost, cluster, target_len=target,
                    state_bytes_per_param=16.0 if precision != "bf16-true" else 8.0)


def eager_only(cfg: dict, cost_model: CostModel | None = None) -> str | None:
    """Why the config cannot take ``cuda_graphs=True`` whatever the layout (then the search does not offer it), or
    None: it trains on the CPU, its profile was measured on a CPU (it plans for the machine it measured), or its
    strategy asks for gradient_accumulation_fusion=True (which the strategy refuses with graphs; the planner keeps the
    config's choice)."""
    device = getattr(cost_model, "device", None)
    if device is not None and getattr(device, "name", None) == "cpu":
        return "the profile was measured on a CPU (CUDA graphs need CUDA devices)"
    trainer = cfg.get("trainer") or {}
    if str(trainer.get("accelerator", "auto")).lower() == "cpu":
        return "trainer.accelerator is 'cpu' (CUDA graphs need CUDA devices)"
    if strategy_options(cfg).get("gradient_accumulation_fusion") is True:
        return "the strategy sets gradient_accumulation_fusion=True, which cuda_graphs=True refuses"
    return None


def emit(cfg: dict, p: Prediction, cluster: ClusterSpec, num_gpus: int, global_batch_size: int) -> dict:
    """The training config for prediction ``p``, checked by the strategy's constructor."""
    c = p.candidate
    out = copy.deepcopy(cfg)
    trainer = out.setdefault("trainer", {})
    trainer["devices"] = min(num_gpus, cluster.gpus_per_node)
    trainer["num_nodes"] = max(1, num_gpus // cluster.gpus_per_node)
    init = {
        "data_parallel_size": c.dp, "pipeline_parallel_size": c.pp, "tensor_parallel_size": c.tp,
        "num_microbatches": c.num_microbatches, "schedule": c.schedule, "compression": c.compression,
    }
    if c.schedule == "interleaved_1f1b":
        init["virtual_stages"] = c.virtual_stages
    if c.cuda_graphs:
        init["cuda_graphs"] = True
    from lightning_3d.planner.search import even_split

    if c.num_stages > 1 and tuple(c.layer_split) != even_split(sum(c.layer_split), c.num_stages):
        init["pipeline_layer_split"] = list(c.layer_split)
    elif c.virtual_stages > 1 and sum(c.layer_split) % c.num_stages:
        init["pipeline_layer_split"] = list(c.layer_split)
    ckpt = list(c.stage_checkpointing)
    model_args = out.setdefault("model", {}).setdefault("init_args", {})
    if all(ckpt) or not any(ckpt):
        model_args["activation_checkpointing"] = bool(all(ckpt))
    else:
        if not strategy_supports_stage_checkpointing():
            raise ValueError("per-stage activation checkpointing needs a strategy with stage_activation_checkpointing;"
                             " plan with per_stage_checkpointing=False.")
        model_args["activation_checkpointing"] = False
        init["stage_activation_checkpointing"] = ckpt
    old_init = strategy_options(cfg)
    keep = {k: v for k, v in old_init.items() if k not in init and k not in (
        "virtual_stages", "pipeline_layer_split", "stage_activation_checkpointing", "cuda_graphs")}
    # Written in the grouped form (strategies/config.py), whichever form the input config used.
    trainer["strategy"] = {"class_path": "lightning_3d.Compressed3DStrategy", "init_args": nest_options({**init, **keep})}
    data = out.setdefault("data", {}).setdefault("init_args", {})
    data["batch_size"] = global_batch_size // c.dp
    Compressed3DStrategy(**trainer["strategy"]["init_args"])  # the strategy's own checks; raises if invalid
    return out


def plan(config: str | Path | dict, gpus: int, *, cluster: ClusterSpec | str | Path | None = None,
         profile: str | Path | None = None, cost_model: CostModel | None = None, global_batch_size: int | None = None,
         options: SearchOptions | None = None) -> Plan:
    """Search the configurations of ``config`` (a training YAML, its dict or a packaged name) on ``gpus`` GPUs."""
    if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1:
        raise ValueError(f"gpus={gpus!r} must be a positive integer.")
    cfg = load_config(config)
    if profile is not None and cost_model is None:
        cost_model = ProfiledCostModel(profile, derive_tp=True)
    if cluster is None:
        # One node of the profiled GPU (its bus bandwidth where the profile measured one), else of H100s.
        device = getattr(cost_model, "device", None)
        cluster = ClusterSpec.single_node(gpus, device if device is not None and device.memory_bytes > 0 else "h100")
        measured = (getattr(cost_model, "collectives", None) or {}).get("intra_node_bandwidth")
        if measured:
            from dataclasses import replace as _replace

            cluster = _replace(cluster, intra_node_bandwidth=float(measured))
    elif not isinstance(cluster, ClusterSpec):
        cluster = ClusterSpec.load(cluster)
    if gpus > cluster.num_gpus:
        raise ValueError(f"gpus={gpus} but the cluster has {cluster.num_gpus} ({cluster.nodes} x {cluster.gpus_per_node}).")
    if gpus > cluster.gpus_per_node and gpus % cluster.gpus_per_node:
        raise ValueError(f"gpus={gpus} must fill whole nodes of {cluster.gpus_per_node} GPUs.")
    w = workload_from_config(cfg, cluster, cost_model, global_batch_size)
    measured = getattr(cost_model, "shape", None)
    if measured is not None and measured != w.shape:
        raise ValueError(f"The profile ({getattr(cost_model, 'source', '?')}) was measured for {measured}, but the config"
                         f" describes {w.shape}. Profile this config's model (`lightning-3d profile --config ...`).")
    opts = options or SearchOptions()
    if opts.per_stage_checkpointing and not strategy_supports_stage_checkpointing():
        from dataclasses import replace

        opts = replace(opts, per_stage_checkpointing=False)
    if any(opts.cuda_graphs) and eager_only(cfg, cost_model):
        from dataclasses import replace

        opts = replace(opts, cuda_graphs=(False,))
    result = search(w, gpus, opts)
    if not result.top:
        raise ValueError(f"No configuration of {w.shape.family.upper()} ({len(w.block_kinds())} layers, hidden"
                         f" {w.shape.hidden_size}, global batch {w.global_batch_size} x {w.seq_len} tokens) fits {gpus}"
                         f" GPUs: " + " ".join(result.shortfall))
    configs = [emit(cfg, p, cluster, gpus, w.global_batch_size) for p in result.top]
    return Plan(configs, result.top, result, gpus, cluster)


def plan_main(argv: list[str]) -> int:
    """``lightning-3d plan --config MODEL.yaml --gpus N [--cluster FILE] [--profile FILE] --out PLAN.yaml``."""
    parser = argparse.ArgumentParser(prog="lightning-3d plan", description="search (dp, pp, tp), micro-batching,"
                                     " schedule, stage split, checkpointing and compression; write a runnable config")
    parser.add_argument("--config", required=True, help="training YAML (or packaged config name) to plan for")
    parser.add_argument("--gpus", type=int, required=True, help="number of GPUs to plan for")
    parser.add_argument("--cluster", default=None, help="cluster file (YAML/JSON; docs/planner.md); default: one node of H100s")
    parser.add_argument("--profile", default=None, help="profile from `lightning-3d profile` (default: analytic costs)")
    parser.add_argument("--global-batch-size", type=int, default=None, help="sequences per step (default: the config's)")
    parser.add_argument("--time-budget", type=float, default=60.0, help="search seconds at most")
    parser.add_argument("--top-k", type=int, default=3)
    parser.add_argument("--out", required=True, help="where to write the plan YAML (the best; others as PLAN.<k>.yaml)")
    ns = parser.parse_args(argv)
    try:
        result = plan(ns.config, ns.gpus, cluster=ns.cluster, profile=ns.profile, global_batch_size=ns.global_batch_size,
                      options=SearchOptions(time_budget_s=ns.time_budget, top_k=ns.top_k))
    except (ValueError, FileNotFoundError) as err:
        parser.error(str(err))
    out = Path(ns.out)
    out.write_text(result.yaml(0))
    for k in range(1, len(result.configs)):
        out.with_name(f"{out.stem}.{k}{out.suffix or '.yaml'}").write_text(result.yaml(k))
    for k, p in enumerate(result.predictions):
        s = p.summary()
        print(f"#{k}: dp={s['dp']} pp={s['pp']} tp={s['tp']} mbs={s['microbatch_size']} m={s['num_microbatches']}"
              f" {s['schedule']} v={s['virtual_stages']} split={s['layer_split']} ckpt={s['stage_checkpointing']}"
              f" compression={s['compression']} cuda_graphs={s['cuda_graphs']}: {s['step_time_s'] * 1e3:.1f} ms,"
              f" {s['peak_memory_gib']:.2f} GiB")
    print(f"wrote {out}")
    return 0
