"""Context parallelism inside ``Compressed3DStrategy`` at world 4, in one process group, against one process.

1. Layouts with a "cp" mesh dimension — (cp 2, pp 2), (cp 2, tp 2 with sequence parallelism), (cp 2, dp 2,
   contiguous slices), cp 4 alone with activation checkpointing, and Ulysses attention at (cp 2, dp 2) with the
   optimizer state sharded over the 4 replicas (dp x cp) — train the tiny causal GPT on batches
   with randomly ignored labels (cp ranks then hold different numbers of loss terms): losses and final parameters
   equal single-process training (``common.reference``).
2. Checkpoints: a run at dp 2 x cp 2 saved after 2 steps resumes at cp 1 (dp 4) and at cp 4 for its third step,
   with the losses and parameters of 3 straight steps (parameters are replicated over cp: nothing to reshard).
3. SC over dp x cp: selective compression on the dp 1 x cp 2 group compresses (bytes after < before) and keeps the
   replicated parameters identical on both cp ranks.
4. Bad values raise the same message on every rank before any collective: a sequence not divisible by 2·cp,
   packed documents, attention dropout, Ulysses with heads not divisible by cp, a module without context support.
"""

from __future__ import annotations

import time
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_3d import Compressed3DStrategy
from lightning_3d.context import context_parallel_config
from lightning_3d.strategies.context_parallel import check_context_module, shard_microbatches
from tests.scenarios.common import LossRecorder, TestData, all_max, compare, make_model, parse_args, reference, trainer, write_report
from tests.scenarios.features import resumable_data

STEPS = 3
LAYOUTS = [
    dict(dp=1, pp=2, cp=2, tp=1, m=4),
    dict(dp=1, pp=1, cp=2, tp=2, m=2, sp=True),
    dict(dp=2, pp=1, cp=2, tp=1, m=2, layout="contiguous"),
    dict(dp=1, pp=1, cp=4, tp=1, m=2, ac=True),  # the ring re-run by activation checkpointing in the backward
    dict(dp=2, pp=1, cp=2, tp=1, m=2, attention="ulysses", shard=True),  # optimizer state sharded over dp x cp = 4
]


def strategy(dp: int, pp: int, cp: int, tp: int, m: int, **kw) -> Compressed3DStrategy:
    kw.setdefault("compression", False)
    kw.setdefault("gradient_accumulation_fusion", True)  # the tiny models' weights are below the "auto" threshold
    return Compressed3DStrategy(data_parallel_size=dp, pipeline_parallel_size=pp, tensor_parallel_size=tp,
                                context_parallel_size=cp, num_microbatches=m, **kw)


def run_layout(cfg: dict) -> dict:
    s = strategy(cfg["dp"], cfg["pp"], cfg["cp"], cfg["tp"], cfg["m"], sequence_parallel=cfg.get("sp", False),
                 context_parallel_layout=cfg.get("layout", "zigzag"), context_parallel_attention=cfg.get("attention", "ring"),
                 stage_activation_checkpointing=[True] * cfg["pp"] if cfg.get("ac") else None,
                 shard_optimizer_state=cfg.get("shard", False))
    global_batch = cfg["dp"] * cfg["m"] * 2
    recorder, model = LossRecorder(), make_model()
    start = time.perf_counter()
    trainer(s, STEPS, [recorder]).fit(model, datamodule=TestData(global_batch, masked=True))
    result = compare(model, recorder.losses, reference(STEPS, global_batch, masked=True))
    mesh = s.device_mesh
    sharded = s.engine.sharded  # kept until the next setup releases the module
    return {**cfg, "mesh": list(mesh.mesh_dim_names), "mesh_shape": list(mesh.mesh.shape),
            "optimizer_sharded_over": sharded.dp_size if sharded is not None else 1,
            "loss_err": all_max(result["loss_err"]), "param_err": all_max(result["param_err"]),
            "seconds": round(time.perf_counter() - start, 2)}


def full_params(model) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def param_err(model, expected: list[torch.Tensor]) -> float:
    return all_max(max(((p.detach() - e).norm() / e.norm().clamp_min(1e-12)).item()
                       for p, e in zip(model.parameters(), expected, strict=True)))


def resume_across_cp(workdir: Path) -> dict:
    """3 steps at dp 2 x cp 2 saving a checkpoint after the second; its third step again at dp 4 (cp 1) and cp 4."""
    straight, model = LossRecorder(), make_model()
    saver = ModelCheckpoint(dirpath=workdir / "cp2", every_n_train_steps=2, save_top_k=-1)
    trainer(strategy(2, 1, 2, 1, 2), 3, [straight, saver], enable_checkpointing=True).fit(
        model, datamodule=resumable_data(8))
    expected = full_params(model)
    path = str(next((workdir / "cp2").glob("*step=2*.ckpt")))
    out = {"straight": straight.losses}
    for name, (dp, cp, m) in {"dp4_cp1": (4, 1, 2), "dp1_cp4": (1, 4, 2)}.items():
        recorder, resumed = LossRecorder(), make_model()
        trainer(strategy(dp, 1, cp, 1, m), 3, [recorder]).fit(resumed, datamodule=resumable_data(8), ckpt_path=path)
        out[name] = {"losses": recorder.losses,
                     "loss_err": all_max(abs(recorder.losses[-1] - straight.losses[-1]) / abs(straight.losses[-1])),
                     "param_err": param_err(resumed, expected)}
    return out


def selective_over_dp_cp() -> dict:
    """SC (PowerSGD, rank 4, from the second step) on the gradients of the dp 1 x cp 2 groups."""
    s = strategy(1, 1, 2, 2, 2, compression=True, compressed_stages=[0], sc_rank=4, sc_warmup=1,
                 sc_min_compression_ratio=0.0)
    recorder, model = LossRecorder(), make_model()
    trainer(s, STEPS, [recorder]).fit(model, datamodule=TestData(4))
    grads = s.communication_stats()["dp_gradients"]
    # Replicated over cp: both cp ranks of a tensor-parallel rank hold the same shards after every compressed step.
    spread = 0.0
    group = s.groups.dp_group
    for p in model.parameters():
        mine = (p.to_local() if hasattr(p, "to_local") else p).detach()
        theirs = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
        dist.all_gather(theirs, mine.contiguous(), group=group)
        spread = max(spread, max((t - mine).abs().max().item() for t in theirs))
    return {"compressing": s.selective_compression is not None, "bytes_before": all_max(grads["bytes_before"]),
            "bytes_after": all_max(grads["bytes_after"]), "replica_spread": all_max(spread),
            "losses_finite": all(torch.isfinite(torch.tensor(recorder.losses)).tolist())}


def message(fn) -> str:
    try:
        fn()
    except (ValueError, TypeError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def bad_values() -> dict:
    """Each raised without communication (so on every rank alike); rank 0 reports, all ranks are compared."""
    cfg = context_parallel_config(2, "zigzag", "ring")
    group = dist.new_group([0, 1]), dist.new_group([2, 3])
    cp_group = group[dist.get_rank() // 2]
    ids = torch.zeros(2, 6, dtype=torch.long)
    keys = ("input_ids", "labels")
    dropout = make_model(dropout=0.1)
    dropout.configure_model()
    plain = pl.LightningModule()
    return {
        "length": message(lambda: shard_microbatches([{"input_ids": ids, "labels": ids}], cfg, 0, keys)),
        "sp_length": message(lambda: shard_microbatches([{"input_ids": torch.zeros(2, 12, dtype=torch.long),
                                                          "labels": torch.zeros(2, 12, dtype=torch.long)}], cfg, 0, keys, 4)),
        "packed": message(lambda: shard_microbatches([{"input_ids": ids, "labels": ids, "document_ids": ids}], cfg, 0, keys)),
        "dropout": message(lambda: dropout.enable_context_parallel(dropout.model, cp_group, "zigzag", "ring")),
        "ulysses_heads": message(lambda: make_model(num_heads=3, hidden_size=48).enable_context_parallel(
            torch.nn.Module(), cp_group, "zigzag", "ulysses")),
        "plain_module": message(lambda: check_context_module(plain, cfg, protocol=False)),
    }


def run_all(workdir: Path, report: Path | None = None) -> dict:
    """Every check above, in this process group (``tests/scenarios/context.py`` calls it after its ring checks, so
    the suite starts the 4 processes once); partial results go to ``report`` as they come."""
    results = []
    for cfg in LAYOUTS:
        results.append(run_layout(cfg))
        if report is not None:
            write_report(report, {"layouts": results})
    out = {"layouts": results, "resume": resume_across_cp(workdir), "selective": selective_over_dp_cp()}
    errors = bad_values()
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, errors)
    return {**out, "errors": errors, "errors_same_on_every_rank": all(e == errors for e in everyone)}


def main() -> None:
    args = parse_args()
    if args.extra.startswith("only:"):  # debugging: some layouts by index, nothing else
        write_report(args.report, {"layouts": [run_layout(LAYOUTS[int(i)]) for i in args.extra[5:].split(",")]})
        return
    write_report(args.report, run_all(args.report.parent, args.report))


if __name__ == "__main__":
    main()
