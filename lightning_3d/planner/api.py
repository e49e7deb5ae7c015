"""``lightning_3d.planner.plan(...)`` (behind ``lightning-3d plan``, planner/command.py): read a training config, search
over its parallel layout and speed options (the model's ``compile`` too, where the profile prices it), and emit a config
that ``lightning-3d fit --config PLAN.yaml`` runs unchanged (the input with its strategy, devices, micro-batching
and checkpointing replaced), with the prediction in a comment. Every emitted strategy section is checked by
constructing ``Compressed3DStrategy(**init_args)`` (the strategy's own validation) before it is written, in the
strategy's grouped form (``parallelism``, ``pipeline``, ``compression``, ``runtime``).

Configs are read with ``yaml.safe_load``; the model is recognised by its class path among the recipes registered
with ``lightning_3d.costs.register_recipe`` (``import lightning_3d.recipes`` registers GPT and T5; the CLI does it).
No class from the file is imported or instantiated.
"""

from __future__ import annotations

import copy
import json
import warnings
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

import yaml

from lightning_3d.costs import AnalyticCostModel, ClusterSpec, CostModel, ProfiledCostModel, device_spec, recipe_costs
from lightning_3d.pipeline.schedules import schedule_spec
from lightning_3d.planner import context
from lightning_3d.planner.cluster import check_regime, cluster_for
from lightning_3d.planner.confidence import RunnerUp, label, runner_ups, within_error
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
    the text ``lightning-3d plan`` writes. ``runner_ups``: the predictions the model cannot tell from the best
    (within ``model_error``; planner/confidence.py). ``measured``: after ``verify``, per index the measured step
    seconds (``median_s``, ``steps_s``) or why the run failed (``error``), and the order is by measured time."""

    configs: list[dict]
    predictions: list[Prediction]
    result: SearchResult
    num_gpus: int
    cluster: ClusterSpec
    measured: dict[int, dict] = field(default_factory=dict)

    @property
    def best(self) -> dict:
        return self.configs[0]

    @property
    def model_error(self) -> float:
        return self.result.model_error

    @property
    def runner_ups(self) -> list[RunnerUp]:
        return runner_ups(self.predictions, self.model_error)

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
        ]
        header += self.measured_lines(index) + (self.confidence_lines() if index == 0 else [])
        header.append("# prediction: " + json.dumps(s))
        if index in self.measured:
            header.append("# measured: " + json.dumps(self.measured[index]))
        return "\n".join(header) + "\n" + yaml.safe_dump(self.configs[index], sort_keys=False)

    def reordered(self, order: list[int], measured: dict[int, dict]) -> Plan:
        """The same plan with its candidates in ``order`` and ``measured`` (by new index) attached."""
        return Plan([self.configs[k] for k in order], [self.predictions[k] for k in order], self.result, self.num_gpus,
                    self.cluster, measured)

    def confidence_lines(self) -> list[str]:
        """The runner-ups within the model's error, each with the measurement that would tell it from the best."""
        ups = self.runner_ups
        best = min(range(len(self.predictions)), key=lambda k: self.predictions[k].step_time)
        lines = [f"# Runner-ups within the model's error (+-{self.model_error * 100:.1f} % per prediction)"
                 + (f" of the fastest predicted, PLAN.{best}" if best else "") + f": {len(ups) or 'none'}"
                 + ("" if ups else " - the choice stands on the model alone.")]
        for r in ups:
            lines.append(f"#   PLAN.{r.rank}: {r.sentence(self.predictions[best])}")
        if ups:
            lines.append("# runner_ups: " + json.dumps([r.to_dict(self.predictions[best]) for r in ups]))
        return lines

    def measured_lines(self, index: int) -> list[str]:
        if not self.measured:
            return []
        out = []
        if index == 0:
            out.append(f"# Verified: {len(self.measured)} candidates run for a few steps each; this is the fastest"
                       " measured (median step):")
            for k in sorted(self.measured):
                out.append(f"#   {'*' if k == 0 else ' '} PLAN.{k}: {verify_note(self.predictions[k], self.measured[k])}")
        elif index in self.measured:
            out.append(f"# Verified: {verify_note(self.predictions[index], self.measured[index])}")
        return out


def verify_note(p: Prediction, m: dict) -> str:
    """One candidate's measured against predicted step, as the plan's header and the printed summary show it."""
    if m.get("error"):
        return f"{label(p.candidate)}: predicted {p.step_time * 1e3:.1f} ms, run failed ({m['error']})"
    return (f"{label(p.candidate)}: measured {m['median_s'] * 1e3:.1f} ms (median of {len(m['steps_s'])} steps),"
            f" predicted {p.step_time * 1e3:.1f} ms ({(p.step_time / m['median_s'] - 1) * 100:+.1f} %)")


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
            dp = max(1, world // (int(init.get("pipeline_parallel_size", 1)) * int(init.get("tensor_parallel_size", 1))
                                  * int(init.get("context_parallel_size", 1))))
        global_batch_size = int(data.get("batch_size", 8)) * dp
    cost = cost_model if cost_model is not None else AnalyticCostModel(shape, cluster.device)
    # The compression settings the model decides CB and SC by (communication.py): the config's, else the defaults.
    compression = {k: v for k, v in strategy_options(cfg).items()
                   if k in ("cb_rank", "sc_rank", "cb_max_link_gbps", "sc_max_link_gbps") and v is not None}
    return Workload(shape, seq, global_batch_size, cost, cluster, target_len=target,
                    state_bytes_per_param=16.0 if precision != "bf16-true" else 8.0,
                    context_parallel_refusal=context_parallel_refusal(cfg), **compression)


def context_parallel_refusal(cfg: dict) -> str | None:
    """Why the config's model or data cannot train with context parallelism (its recipe's rule), or None."""
    model = cfg.get("model") or {}
    path = model.get("class_path", "lightning_3d.recipes.GPT")
    rule = recipe_costs(path).context_parallel
    if rule is None:
        return f"the model {path} has no context-parallel attention (its recipe registers no rule for it)"
    data = cfg.get("data") or {}
    return rule(dict(model.get("init_args") or {}), data.get("class_path"), dict(data.get("init_args") or {}))


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


def emit(cfg: dict, p: Prediction, cluster: ClusterSpec, num_gpus: int, global_batch_size: int,
         w: Workload | None = None, set_compile: bool = False) -> dict:
    """The training config for prediction ``p``, checked by the strategy's constructor (and, with cp, by the context
    checks the strategy runs later: ``check_context_parallel``, given the workload ``w``). ``set_compile``: the search
    chose the model's ``compile`` (the profile had both grids): written as ``p`` has it; else the config's stays."""
    c = p.candidate
    out = copy.deepcopy(cfg)
    trainer = out.setdefault("trainer", {})
    trainer["devices"] = min(num_gpus, cluster.gpus_per_node)
    trainer["num_nodes"] = max(1, num_gpus // cluster.gpus_per_node)
    init = {
        "data_parallel_size": c.dp, "pipeline_parallel_size": c.pp, "tensor_parallel_size": c.tp,
        "num_microbatches": c.num_microbatches, "schedule": c.schedule, "compression": c.compression,
    }
    if c.cp > 1:
        # The layout the model priced (planner/context.py); checked below as the strategy checks every batch.
        init.update(context_parallel_size=c.cp, context_parallel_layout=context.LAYOUT,
                    context_parallel_attention=c.cp_attention)
    if schedule_spec(c.schedule).interleaved:
        init["virtual_stages"] = c.virtual_stages
    for name in ("cuda_graphs", "sequence_parallel", "shard_optimizer_state"):
        if getattr(c, name):
            init[name] = True
    from lightning_3d.planner.search import even_split

    if c.num_stages > 1 and tuple(c.layer_split) != even_split(sum(c.layer_split), c.num_stages):
        init["pipeline_layer_split"] = list(c.layer_split)
    elif c.virtual_stages > 1 and sum(c.layer_split) % c.num_stages:
        init["pipeline_layer_split"] = list(c.layer_split)
    ckpt = list(c.stage_checkpointing)
    model_args = out.setdefault("model", {}).setdefault("init_args", {})
    if set_compile:
        model_args["compile"] = c.compile
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
        "virtual_stages", "pipeline_layer_split", "stage_activation_checkpointing", "cuda_graphs", "sequence_parallel",
        "shard_optimizer_state", "context_parallel_size", "context_parallel_layout", "context_parallel_attention")}
    # Written in the grouped form (strategies/config.py), whichever form the input config used.
    trainer["strategy"] = {"class_path": "lightning_3d.Compressed3DStrategy", "init_args": nest_options({**init, **keep})}
    data = out.setdefault("data", {}).setdefault("init_args", {})
    data["batch_size"] = global_batch_size // c.dp
    Compressed3DStrategy(**trainer["strategy"]["init_args"])  # the strategy's own checks; raises if invalid
    if c.cp > 1:
        check_context_parallel(c, w)
    return out


def check_context_parallel(c, w: Workload | None) -> None:
    """What the strategy and the GPT check about cp only once processes run (each batch's slices against the layout,
    Ulysses' heads per tp rank, the recipe's dropout and data rule), checked here with the same pure checks
    (``context.refusal``) so that an emitted plan does not fail at fit. Without the workload (a prediction emitted
    for a config by hand) only the strategy's constructor checks it."""
    why = None if w is None else context.refusal(w, c.cp, c.cp_attention, c.tp, c.sequence_parallel)
    if why is not None:
        raise ValueError(f"context_parallel_size={c.cp} with context_parallel_attention={c.cp_attention!r} would fail"
                         f" at fit: {why}. Plan with SearchOptions(context_parallel_sizes=(1,)) or change the config.")


def plan(config: str | Path | dict, gpus: int, *, cluster: ClusterSpec | str | Path | None = None,
         profile: str | Path | None = None, cost_model: CostModel | None = None, global_batch_size: int | None = None,
         options: SearchOptions | None = None, nodes: int | None = None, regime: str | None = None) -> Plan:
    """Search the configurations of ``config`` (a training YAML, its dict or a packaged name) on ``gpus`` GPUs.
    Without ``cluster``: ``nodes`` nodes (default one) of the profiled GPU (else H100s), linked as ``regime`` says
    (planner/cluster.py: "nvlink", "ib", "ethernet")."""
    if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1:
        raise ValueError(f"gpus={gpus!r} must be a positive integer.")
    if cluster is not None and (nodes is not None or regime is not None):
        raise ValueError("a cluster file states its nodes and links itself: pass either cluster (--cluster) or"
                         " nodes/regime (--nodes/--regime), not both.")
    check_regime(regime)
    cfg = load_config(config)
    opts = options or SearchOptions()
    models, chosen = compile_cost_models(cfg, profile, cost_model, opts)
    cost_model = models.get(False, models.get(True))  # the cluster and shape checks read either (same profile)
    if cluster is None:
        # The profiled GPU (its bus bandwidth where the profile measured one), else H100s: one node of eight at most
        # unless nodes says otherwise.
        device = getattr(cost_model, "device", None)
        device = device if device is not None and device.memory_bytes > 0 else device_spec("h100")
        measured = (getattr(cost_model, "collectives", None) or {}).get("intra_node_bandwidth")
        if nodes is None and gpus > 8:
            nodes = -(-gpus // 8)
        cluster = cluster_for(gpus, device, nodes=nodes, regime=regime, nvlink=float(measured) if measured else None)
    elif not isinstance(cluster, ClusterSpec):
        cluster = ClusterSpec.load(cluster)
    if gpus > cluster.num_gpus:
        raise ValueError(f"gpus={gpus} but the cluster has {cluster.num_gpus} ({cluster.nodes} x {cluster.gpus_per_node}).")
    if gpus > cluster.gpus_per_node and gpus % cluster.gpus_per_node:
        raise ValueError(f"gpus={gpus} must fill whole nodes of {cluster.gpus_per_node} GPUs.")
    workloads = {flag: workload_from_config(cfg, cluster, m, global_batch_size) for flag, m in models.items()}
    w = next(iter(workloads.values()))
    measured = getattr(cost_model, "shape", None)
    if measured is not None and measured != w.shape:
        raise ValueError(f"The profile ({getattr(cost_model, 'source', '?')}) was measured for {measured}, but the config"
                         f" describes {w.shape}. Profile this config's model (`lightning-3d profile --config ...`).")
    if opts.per_stage_checkpointing and not strategy_supports_stage_checkpointing():
        opts = replace(opts, per_stage_checkpointing=False)
    if any(opts.cuda_graphs) and eager_only(cfg, cost_model):
        opts = replace(opts, cuda_graphs=(False,))
    result = search_compile(workloads, gpus, opts)
    if not result.top:
        raise ValueError(f"No configuration of {w.shape.family.upper()} ({len(w.block_kinds())} layers, hidden"
                         f" {w.shape.hidden_size}, global batch {w.global_batch_size} x {w.seq_len} tokens) fits {gpus}"
                         f" GPUs: " + " ".join(result.shortfall))
    configs = [emit(cfg, p, cluster, gpus, w.global_batch_size, workloads[p.candidate.compile], set_compile=chosen)
               for p in result.top]
    return Plan(configs, result.top, result, gpus, cluster)


def model_options(cfg: dict) -> dict:
    """The config's ``model.init_args``."""
    return (cfg.get("model") or {}).get("init_args") or {}


def compile_cost_models(cfg: dict, profile: str | Path | None, cost_model: CostModel | None,
                        opts: SearchOptions) -> tuple[dict[bool, CostModel | None], bool]:
    """The cost model for each value of the model's ``compile`` the search tries, and whether the plan sets
    ``compile`` (True where the profile has compiled grids, so the search chose it). From a profile: its eager grids
    (False) and its compiled grids (True) where it has them, as ``opts.compile`` allows (None: both where there are
    compiled grids); a given cost model (or none: the analytic one) prices one kind of block, the config's."""
    asked = bool(model_options(cfg).get("compile", False))
    if profile is None or cost_model is not None:
        flag = bool(getattr(cost_model, "compiled", asked)) if cost_model is not None else asked
        if opts.compile is not None and flag not in opts.compile:
            raise ValueError(f"SearchOptions(compile={opts.compile!r}): the cost model given prices compile={flag}"
                             " blocks only; pass a profile (with compiled grids: `lightning-3d profile --compile`).")
        return {flag: cost_model}, False
    eager = ProfiledCostModel(profile, derive_tp=True)
    try:
        compiled, why = ProfiledCostModel(profile, derive_tp=True, compiled=True), None
    except ValueError as err:
        compiled, why = None, str(err)
    wanted = opts.compile if opts.compile is not None else ((False, True) if compiled is not None else (False,))
    if True in wanted and compiled is None:
        raise ValueError(f"SearchOptions(compile={opts.compile!r}) needs the profile's compiled grids: {why}")
    if asked and compiled is None:
        warnings.warn(f"The config compiles its model (compile={model_options(cfg).get('compile')!r}), but the profile"
                      f" has no compiled grids: the plan prices eager blocks ({why})", stacklevel=3)
    return {flag: (compiled if flag else eager) for flag in sorted(set(wanted))}, compiled is not None


def search_compile(workloads: dict[bool, Workload], gpus: int, opts: SearchOptions) -> SearchResult:
    """``search`` once per compile value (each workload with its cost model, the time budget shared), the candidates
    tagged with their value and merged: the top-k by predicted step time, and every further one within the model's
    error of the best (as ``search`` keeps them)."""
    share = replace(opts, time_budget_s=opts.time_budget_s / len(workloads))
    results = {flag: search(w, gpus, share) for flag, w in workloads.items()}
    tagged = sorted((replace(p, candidate=replace(p.candidate, compile=flag))
                     for flag, r in results.items() for p in r.top), key=lambda p: p.step_time)
    error = next(iter(results.values())).model_error
    top = tagged[: opts.top_k] + [p for p in tagged[opts.top_k:] if within_error(tagged[0].step_time, p.step_time, error)]
    shortfall = [] if top else [line for r in results.values() for line in r.shortfall]
    return SearchResult(top, sum(r.skeletons for r in results.values()), sum(r.evaluated for r in results.values()),
                        sum(r.seconds for r in results.values()), any(r.truncated for r in results.values()),
                        list(dict.fromkeys(shortfall)), error)
