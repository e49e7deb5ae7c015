"""``lightning-3d plan``: the command line's arguments into ``api.plan`` (and ``verify``), the plan's YAML files
written, and the printed summary. The search and the configs it emits live in ``api.py``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from lightning_3d.context import ATTENTIONS
from lightning_3d.planner.api import Plan, plan
from lightning_3d.planner.cluster import REGIME_GBPS
from lightning_3d.planner.search import SearchOptions


def _context_search(ns: argparse.Namespace) -> dict:
    """The command line's context-parallel search options as ``SearchOptions`` keywords (only those given)."""
    out: dict = {}
    if ns.context_parallel_sizes is not None:
        out["context_parallel_sizes"] = tuple(ns.context_parallel_sizes)
    if ns.context_parallel_attention is not None:
        out["context_parallel_attention"] = tuple(ns.context_parallel_attention)
    return out


def plan_main(argv: list[str]) -> int:
    """``lightning-3d plan --config MODEL.yaml --gpus N [--cluster FILE] [--profile FILE] --out PLAN.yaml [--verify]``."""
    parser = argparse.ArgumentParser(prog="lightning-3d plan", description="search (dp, pp, cp, tp), micro-batching,"
                                     " schedule, stage split, checkpointing and compression; write a runnable config")
    parser.add_argument("--config", required=True, help="training YAML (or packaged config name) to plan for")
    parser.add_argument("--gpus", type=int, required=True, help="number of GPUs to plan for")
    parser.add_argument("--cluster", default=None, help="cluster file (YAML/JSON; docs/planner.md); default: one node of"
                        " the profiled GPU (H100s without a profile)")
    parser.add_argument("--nodes", type=int, default=None, help="without --cluster: nodes of the profiled GPU (default 1)")
    parser.add_argument("--regime", default=None, choices=tuple(REGIME_GBPS), help="without --cluster: the link regime"
                        " (benchmarks/CONVENTIONS.md): between the nodes, or every link on one node")
    parser.add_argument("--profile", default=None, help="profile from `lightning-3d profile` (default: analytic costs)")
    parser.add_argument("--global-batch-size", type=int, default=None, help="sequences per step (default: the config's)")
    parser.add_argument("--time-budget", type=float, default=60.0, help="search seconds at most")
    parser.add_argument("--top-k", type=int, default=3)
    parser.add_argument("--model-error", type=float, default=None, help="the model's time error as a fraction; runner-ups"
                        " within it of the best are listed (default: the validated error, docs/planner.md)")
    parser.add_argument("--context-parallel-sizes", type=int, nargs="+", default=None, metavar="CP",
                        help="context-parallel degrees to search where the model and sequence allow them (default:"
                             " every divisor of the GPUs; 1: none)")
    parser.add_argument("--context-parallel-attention", nargs="+", default=None, metavar="ATTENTION",
                        help=f"attentions to search at cp > 1, of {', '.join(ATTENTIONS)} (default: all)")
    parser.add_argument("--verify", action="store_true", help="run the top candidates a few steps each on this machine"
                        " and write the fastest measured")
    parser.add_argument("--verify-top", type=int, default=3, help="candidates to run with --verify")
    parser.add_argument("--verify-steps", type=int, default=5, help="timed steps per candidate with --verify")
    parser.add_argument("--verify-warmup", type=int, default=2, help="untimed steps before them")
    parser.add_argument("--verify-repeats", type=int, default=1, help="fresh runs per candidate, round-robin")
    parser.add_argument("--out", required=True, help="where to write the plan YAML (the best; others as PLAN.<k>.yaml)")
    ns = parser.parse_args(argv)
    try:
        if ns.verify:
            from lightning_3d.planner.verify import check_verify_options

            check_verify_options(ns.verify_top, ns.verify_steps, ns.verify_warmup, ns.verify_repeats)
        result = plan(ns.config, ns.gpus, cluster=ns.cluster, profile=ns.profile, global_batch_size=ns.global_batch_size,
                      nodes=ns.nodes, regime=ns.regime,
                      options=SearchOptions(time_budget_s=ns.time_budget, top_k=max(ns.top_k, ns.verify_top if ns.verify
                                                                                    else 0), model_error=ns.model_error,
                                            **_context_search(ns)))
    except (ValueError, FileNotFoundError) as err:
        parser.error(str(err))
    if ns.verify:
        from lightning_3d.planner.verify import verify

        try:
            result = verify(result, top=ns.verify_top, steps=ns.verify_steps, warmup=ns.verify_warmup,
                            repeats=ns.verify_repeats)
        except RuntimeError as err:
            print(err, file=sys.stderr)
            return 1
    out = Path(ns.out)
    out.write_text(result.yaml(0))
    for k in range(1, len(result.configs)):
        out.with_name(f"{out.stem}.{k}{out.suffix or '.yaml'}").write_text(result.yaml(k))
    print_plan(result)
    print(f"wrote {out}")
    return 0


def print_plan(result: Plan) -> None:
    """The printed summary: every candidate (measured beside predicted after --verify), then the runner-ups."""
    for k, p in enumerate(result.predictions):
        s = p.summary()
        line = (f"#{k}: dp={s['dp']} pp={s['pp']} tp={s['tp']} mbs={s['microbatch_size']} m={s['num_microbatches']}"
                f" {s['schedule']} v={s['virtual_stages']} split={s['layer_split']} ckpt={s['stage_checkpointing']}"
                f" compression={s['compression']} cuda_graphs={s['cuda_graphs']}"
                + "".join(f" {k}=True" for k in ("sequence_parallel", "shard_optimizer_state") if s[k])
                + (f" cp={s['context_parallel_size']} {s['context_parallel_attention']}" if s["context_parallel_size"] > 1
                   else "")
                + (" compile=True" if s["compile"] else "")
                + f": {s['step_time_s'] * 1e3:.1f} ms,"
                f" {s['peak_memory_gib']:.2f} GiB")
        if k in result.measured:
            m = result.measured[k]
            line += f"; run failed ({m['error']})" if "error" in m else f"; measured {m['median_s'] * 1e3:.1f} ms"
        print(line)
    for line in result.confidence_lines():
        if not line.startswith("# runner_ups:"):
            print(line[2:])
