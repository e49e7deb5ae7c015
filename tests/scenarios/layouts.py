"""Every (dp, pp, tp) layout of one world size, with every schedule that applies, against the reference.

A random number of labels per sample is ignored (-100), so data-parallel replicas hold different numbers of
loss terms: the run must still train on the token mean of the whole global batch, like the reference.

One process group runs all of them in sequence (one Trainer each), so the suite pays the process start-up
once per world size.
"""

from __future__ import annotations

import time

import lightning.pytorch as pl
from torch import nn

from lightning_3d import Compressed3DStrategy
from lightning_3d.distributed import wgrad_fusion
from lightning_3d.pipeline.schedules import mark_epilogue, register_schedule
from tests.scenarios.common import (
    LossRecorder,
    TestData,
    all_max,
    compare,
    gpipe_reversed,
    make_model,
    parse_args,
    reference,
    trainer,
    variable_step,
    write_report,
)
from tests.schedule_example import REVERSE_GPIPE

STEPS = 6


def layouts(world: int) -> list[dict]:
    if world == 8:  # the one 8-process layout: every kind of parallelism at once
        return [dict(dp=2, pp=2, tp=2, schedule=s, m=4) for s in ("gpipe", "1f1b", "interleaved_1f1b")]
    runs = []
    for dp in range(1, world + 1):
        for pp in range(1, world + 1):
            if world % (dp * pp):
                continue
            tp = world // (dp * pp)
            if pp == 1:
                runs.append(dict(dp=dp, pp=pp, tp=tp, schedule="1f1b", m=2))
                continue
            m = 6 if pp == 3 else 4
            for schedule in ("gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "zb_interleaved"):
                runs.append(dict(dp=dp, pp=pp, tp=tp, schedule=schedule, m=m))
    return runs


def variants(world: int) -> list[dict]:
    """Extra options checked against the same reference: sequence parallel, accumulation, variable shapes."""
    extra = []
    if world == 2:
        extra += [dict(dp=1, pp=1, tp=2, schedule="1f1b", m=2, sp=True),
                  dict(dp=1, pp=2, tp=1, schedule="1f1b", m=4, variable=True, ordered=True),  # explicit per-step orders
                  # "auto" fusion with its threshold between the model's weight sizes: fused and unfused weights in
                  # one stage and one data-parallel step (separate buckets, docs/speed.md)
                  dict(dp=2, pp=1, tp=1, schedule="1f1b", m=2, variable=True, fusion="auto_mixed"),
                  # the default micro-batch count (pp) and per-stage activation checkpointing (stage 0 only)
                  dict(dp=1, pp=2, tp=1, schedule="1f1b", m=None, stage_ac=[True, False]),
                  dict(dp=1, pp=2, tp=1, schedule="reverse_gpipe", m=4),  # tests/schedule_example.py, registered below
                  # zero bubble with plain (split, unfused) linear layers and checkpointed blocks on both stages
                  dict(dp=1, pp=2, tp=1, schedule="zb_h1", m=4, fusion=False, stage_ac=[True, True]),
                  # interleaved zero bubble likewise, each rank holding a checkpointed and a plain stage
                  dict(dp=1, pp=2, tp=1, schedule="zb_interleaved", m=4, fusion=False,
                       stage_ac=[True, False, False, True])]
    if world == 8:
        return []
    if world == 4:
        extra += [dict(dp=1, pp=2, tp=2, schedule="interleaved_1f1b", m=4, sp=True),
                  dict(dp=2, pp=2, tp=1, schedule="1f1b", m=2, accumulate=2),
                  dict(dp=2, pp=2, tp=1, schedule="1f1b", m=4, fe=False),  # the two-collective tied-embedding sync
                  dict(dp=2, pp=2, tp=1, schedule="interleaved_1f1b", m=4, variable=True),
                  dict(dp=1, pp=2, tp=2, schedule="gpipe", m=4, sp=True, variable=True),
                  # zero bubble: split plain layers whose W feeds the data-parallel buckets, with accumulation
                  dict(dp=2, pp=2, tp=1, schedule="zb_h1", m=4, fusion=False, accumulate=2),
                  dict(dp=2, pp=2, tp=1, schedule="zb_interleaved", m=4, fusion=False, accumulate=2)]
    return extra


class BlockCalls(pl.Callback):
    """Calls of the ``forward`` of the first block of each of this rank's stages: a block whose stage recomputes
    activations runs twice per micro-batch (forward, then again in the backward), once otherwise. Counted on the
    method, since checkpoint's recomputation does not run forward hooks."""

    def __init__(self) -> None:
        self.calls: dict[int, int] = {}

    def on_train_start(self, trainer, module) -> None:
        for index, stage in trainer.strategy.pipeline_runtime.stages.items():
            block = next(iter(stage.layers.values()))
            self.calls[index] = 0
            block.forward = self._counted(block.forward, index)

    def _counted(self, forward, index: int):
        def counted(*args, **kwargs):
            self.calls[index] += 1
            return forward(*args, **kwargs)
        return counted


def run(cfg: dict) -> dict:
    accumulate = cfg.get("accumulate", 1)
    variable = cfg.get("variable", False)
    virtual = None
    if cfg["schedule"] in ("interleaved_1f1b", "zb_interleaved"):
        virtual = 3 if cfg["pp"] == 4 else 2
    strategy = Compressed3DStrategy(
        data_parallel_size=cfg["dp"], pipeline_parallel_size=cfg["pp"], tensor_parallel_size=cfg["tp"],
        num_microbatches=cfg["m"], schedule=cfg["schedule"], virtual_stages=virtual,
        sequence_parallel=cfg.get("sp", False), compression=False, fused_embedding_sync=cfg.get("fe", True),
        stage_activation_checkpointing=cfg.get("stage_ac"),
        # True: every layer (the tiny model's weights are below the "auto" threshold); "auto_mixed": "auto" with the
        # threshold at the MLP weights' size (hidden x ffn), so they are fused and the smaller attention weights not
        gradient_accumulation_fusion="auto" if cfg.get("fusion") == "auto_mixed" else cfg.get("fusion", True),
    )
    m = strategy.num_microbatches  # cfg["m"], or the default the strategy derived
    global_batch = cfg["dp"] * m * 2
    recorder, calls = LossRecorder(), BlockCalls()
    model = make_model()
    threshold = wgrad_fusion.FUSION_MIN_ELEMENTS
    if cfg.get("fusion") == "auto_mixed":
        wgrad_fusion.FUSION_MIN_ELEMENTS = model.config.hidden_size * model.config.ffn_size  # the layers exist at setup
    start = time.perf_counter()
    try:
        trainer(strategy, STEPS, [recorder, calls], accumulate=accumulate).fit(
            model, datamodule=TestData(global_batch, variable=variable, masked=True,
                                       ordered=(cfg["pp"], virtual or 1) if cfg.get("ordered") else None)
        )
    finally:
        wgrad_fusion.FUSION_MIN_ELEMENTS = threshold
    if cfg.get("fusion") == "auto_mixed":  # both kinds of weight trained in the step compared below
        fused = sum(isinstance(l, wgrad_fusion.FusedGradLinear) for l in model.modules())
        plain = sum(type(l) is nn.Linear for l in model.modules())
        cfg = {**cfg, "mixed_fusion": all_max(0.0 if fused > 0 and plain > 0 else 1.0) == 0.0}
    ref = reference(STEPS, global_batch, cfg["dp"] if variable else 0, accumulate, masked=True)
    result = compare(model, recorder.losses, ref)
    if cfg.get("ordered"):  # the explicit orders survived Lightning's batch transfer and ran
        runtime = strategy.pipeline_runtime
        last = variable_step(STEPS - 1, cfg["dp"], 0)
        expected = tuple(mark_epilogue(o) for o in gpipe_reversed(cfg["pp"], virtual or 1, len(last)))
        cfg = {**cfg, "ordered": runtime.last_orders == expected}
    if cfg.get("stage_ac"):  # the runtime ran m micro-batches per step; stage s recomputed exactly where asked
        runtime = strategy.pipeline_runtime
        ran = len({a.microbatch for a in runtime.last_orders[0] if a.kind == "F"})
        expected = {s: STEPS * m * (2 if cfg["stage_ac"][s] else 1) for s in calls.calls}
        cfg = {**cfg, "m": m, "microbatches_run": all_max(float(ran)),
               "recomputed_as_asked": all_max(0.0 if calls.calls == expected else 1.0) == 0.0}
    if cfg["schedule"] in ("zb_h1", "zb_interleaved"):  # the backwards of stages > 0 were split: W ran, on the layers
        # the fusion left (rank 0 of zb_h1 holds only stage 0, whose backward stays whole)
        layers = strategy.engine.split_layers
        split = sum(a.kind == "W" for a in strategy.pipeline_runtime.last_orders[strategy.pp_rank])
        cfg = {**cfg, "w_ran": all_max(float(split > 0 or strategy.pp_rank == 0)),
               "split_layers": all_max(float(len(layers))), "fused_layers": all_max(float(len(strategy.engine.fused_weights)))}
    return {**cfg, "loss_err": all_max(result["loss_err"]), "param_err": all_max(result["param_err"]),
            "seconds": round(time.perf_counter() - start, 2)}


GPU_SUBSET = [dict(dp=1, pp=2, tp=2, schedule="interleaved_1f1b", m=4, sp=True), dict(dp=2, pp=2, tp=1, schedule="1f1b", m=4),
              dict(dp=1, pp=4, tp=1, schedule="gpipe", m=4), dict(dp=4, pp=1, tp=1, schedule="1f1b", m=2),
              dict(dp=1, pp=1, tp=4, schedule="1f1b", m=2), dict(dp=2, pp=2, tp=1, schedule="interleaved_1f1b", m=4, variable=True)]


def main() -> None:
    args = parse_args()
    register_schedule(REVERSE_GPIPE)  # a new schedule is one file plus this line (docs/extending.md)
    plan = GPU_SUBSET if args.extra == "gpu_subset" else layouts(args.world) + variants(args.world)
    results = []
    for cfg in plan:
        results.append(run(cfg))
        write_report(args.report, {"results": results})  # partial results survive a later failure
    if args.world == 4 and args.extra != "gpu_subset":  # zero bubble with CB (B's sends compressed) and ZeRO-1
        from tests.scenarios.compression import exact_at_full_rank
        from tests.scenarios.sharded_optimizer import layout as sharded_layout

        write_report(args.report, {"results": results, "zb_cb": exact_at_full_rank(1, 4, 1, schedule="zb_h1"),
                                   "zb_sharded": sharded_layout(2, 2, 1, 4, schedule="zb_h1"),
                                   # at (2,2,1): its W's feed the data-parallel buckets while CB compresses B's sends
                                   "zbi_cb": exact_at_full_rank(2, 2, 1, schedule="zb_interleaved")})
    if args.world == 8 and args.extra != "gpu_subset":  # (2,2,2) with compression, in the same process group
        from tests.scenarios.compression import exact_at_full_rank, full_stack_222
        from tests.scenarios.sharded_optimizer import layout as sharded_layout

        write_report(args.report, {"results": results, "exact_222": exact_at_full_rank(2, 2, 2),
                                   "full_stack_222": full_stack_222(), "sharded_222": sharded_layout(2, 2, 2, 4)})


if __name__ == "__main__":
    main()
