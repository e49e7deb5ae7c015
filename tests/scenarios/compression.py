"""Optimus-CC on 4 processes: exactness where it must be exact, counts and bytes where they are analytic,
and a compressed run that still learns."""

from __future__ import annotations

import torch

from lightning_3d import Compressed3DStrategy
from tests.scenarios.common import (
    LossRecorder,
    Progressions,
    TestData,
    all_max,
    compare,
    make_model,
    parse_args,
    reference,
    trainer,
    write_report,
)

H, SEQ_LEN = 48, 16


def strategy(dp, pp, tp, m, **kw) -> Compressed3DStrategy:
    """LEP on wherever compression is (it is off by default), and CB whatever the link: these scenarios check both."""
    if kw.get("compression", True):
        kw.setdefault("cb_lazy_error_propagation", True)
        kw.setdefault("compressed_backprop", True)  # CB is what these check; the link decision has tests of its own
    kw.setdefault("gradient_accumulation_fusion", True)  # the tiny models' weights are below the "auto" threshold
    return Compressed3DStrategy(data_parallel_size=dp, pipeline_parallel_size=pp, tensor_parallel_size=tp,
                                num_microbatches=m, **kw)


def exact_at_full_rank(dp: int, pp: int, tp: int, **kw) -> dict:
    """CB at full rank (rank >= hidden) with LEP on every send, SC still in its warm-up, FE: equal to the uncompressed
    run. ``kw``: more strategy options (a schedule)."""
    recorder, model = LossRecorder(), make_model()
    s = strategy(dp, pp, tp, 4, cb_rank=64, cb_epilogue_only=False, cb_min_compression_ratio=0.0, sc_warmup=100, **kw)
    trainer(s, 6, [recorder]).fit(model, datamodule=TestData(dp * 8))
    result = compare(model, recorder.losses, reference(6, dp * 8))
    sends = sum(s.compressed_backprop.compressed_sends.values()) if s.compressed_backprop else 0
    return {"layout": [dp, pp, tp], "loss_err": all_max(result["loss_err"]), "param_err": all_max(result["param_err"]),
            "compressed_sends": all_max(sends)}


def epilogue_counts(schedule: str, epilogue_only: bool) -> dict:
    """Compressed sends per stage in one step of a 4-stage pipeline with 8 micro-batches."""
    virtual = 3 if schedule == "interleaved_1f1b" else None  # 12 layers over 4 x 3 stages
    s = strategy(1, 4, 1, 8, schedule=schedule, virtual_stages=virtual, cb_rank=4, cb_min_compression_ratio=0.0,
                 cb_epilogue_only=epilogue_only)
    trainer(s, 1).fit(make_model(), datamodule=TestData(16))
    counts = torch.zeros(12)  # per stage (with interleaving a rank sends for several stages)
    for stage, sends in s.compressed_backprop.compressed_sends.items():
        counts[stage] = float(sends)
    torch.distributed.all_reduce(counts)
    return {"schedule": schedule, "epilogue_only": epilogue_only, "per_stage": counts.tolist()}


def selective_and_bytes() -> dict:
    """(2,2,1), SC on stage 0 only after 2 warm-up steps (IEEE fp32 products), CB rank 4 on every send: which stages
    compress, with which options, and the byte counts."""
    s = strategy(2, 2, 1, 4, cb_rank=4, cb_epilogue_only=False, cb_min_compression_ratio=0.0, sc_rank=4, sc_warmup=2,
                 compressed_stages=[0], sc_matmul_precision="fp32")
    model = make_model()
    trainer(s, 4).fit(model, datamodule=TestData(16))
    stats = s.communication_stats()
    sc = s.selective_compression
    row = [stats[k][b] for k in ("forward_activations", "backward_activation_grads", "dp_gradients")
           for b in ("bytes_before", "bytes_after")]
    row += [stats["embedding_sync"]["bytes_before"], float(sc is not None), float(sc.state.iter if sc else -1),
            expected_dp_bytes(model, s), float(s.pp_rank), float(sc.matmul_precision == "fp32" if sc else -1)]
    gathered = torch.zeros(4, len(row), dtype=torch.float64)
    gathered[torch.distributed.get_rank()] = torch.tensor(row, dtype=torch.float64)
    torch.distributed.all_reduce(gathered)
    return {"rows": gathered.tolist()}


def expected_dp_bytes(model, s) -> float:
    """dp_gradients bytes of this rank after 4 steps: 2 plain steps, then 2 PowerSGD steps (rank 4) if compressed."""
    params = [p for p in model.parameters() if id(p) not in {id(t) for t in s.engine.tied}]
    plain = sum(p.numel() for p in params) * 4
    if s.selective_compression is None:
        return 4.0 * plain
    compressed = 0
    for p in params:
        rows, cols = p.shape[0], p.numel() // p.shape[0]
        rank = min(rows, cols, 4)
        compressed += (rows + cols) * rank if p.ndim > 1 and (rows + cols) * rank * 2.0 < rows * cols else p.numel()
    return 2.0 * plain + 2.0 * compressed * 4


def learns() -> dict:
    """Everything on at small ranks (CB on every send) still learns a learnable task, close to the uncompressed run.
    Tiny DP buckets split the exact last stage into many asynchronous all-reduces, finished after the SC stage's one
    bucket (SC ignores the bucket size) on the other pipeline rank."""
    out = {}
    for name, kw in (("uncompressed", dict(compression=False)),
                     ("compressed", dict(cb_rank=4, cb_epilogue_only=False, sc_rank=4, sc_warmup=2, bucket_size_mb=0.005))):
        recorder = LossRecorder()
        model = make_model(decay_steps=30)
        trainer(strategy(2, 2, 1, 4, **kw), 30, [recorder]).fit(model, datamodule=TestData(16, dataset=Progressions))
        out[name] = recorder.losses
    return out


def full_stack_222() -> dict:
    """The full 3D compression layouts on CPU, in the 8-process group: the whole stack (CB + LEP on every send, FE, SC
    on both stages) at (2,2,2)
    learns, and every kind of traffic that can shrink did (bytes summed over the 8 ranks)."""
    recorder, model = LossRecorder(), make_model(decay_steps=24)
    s = strategy(2, 2, 2, 4, cb_rank=4, cb_epilogue_only=False, cb_min_compression_ratio=0.0, sc_rank=4, sc_warmup=2,
                 compressed_stages=[0, 1])
    trainer(s, 24, [recorder]).fit(model, datamodule=TestData(16, dataset=Progressions))
    stats = s.communication_stats()
    kinds = ("forward_activations", "backward_activation_grads", "dp_gradients", "embedding_sync")
    sent = torch.tensor([[stats[k]["bytes_before"], stats[k]["bytes_after"]] for k in kinds], dtype=torch.float64)
    torch.distributed.all_reduce(sent)
    return {"losses": recorder.losses, "bytes": {k: row for k, row in zip(kinds, sent.tolist())}}


def link_decides() -> dict:
    """Default compressed_stages at (2,2,1): SC follows the data-parallel all-reduce measured at setup. Whatever gloo's
    speed, it is above 1e-9 GB/s (SC off) and below infinity (SC on, on stage 0). Rows: [GB/s, SC on, pp rank]."""
    out = {}
    for name, threshold in (("tiny_threshold", 1e-9), ("infinite_threshold", float("inf"))):
        s = strategy(2, 2, 1, 2, sc_max_link_gbps=threshold, sc_warmup=0)
        trainer(s, 1).fit(make_model(), datamodule=TestData(8))
        rows = torch.zeros(4, 3, dtype=torch.float64)
        rows[torch.distributed.get_rank()] = torch.tensor(
            [s.data_parallel_link_gbps, float(s.selective_compression is not None), float(s.pp_rank)], dtype=torch.float64)
        torch.distributed.all_reduce(rows)
        out[name] = rows.tolist()
    return out


def main() -> None:
    args = parse_args()
    report = {
        "exact": [exact_at_full_rank(2, 2, 1), exact_at_full_rank(1, 2, 2)],
        "epilogue": [epilogue_counts("1f1b", True), epilogue_counts("1f1b", False), epilogue_counts("gpipe", True),
                     epilogue_counts("interleaved_1f1b", True)],
        "selective": selective_and_bytes(),
        "learning": learns(),
        "link": link_decides(),
    }
    write_report(args.report, report)


if __name__ == "__main__":
    main()
