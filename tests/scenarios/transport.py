"""The pipeline transport on its own: groups it creates, the order of its operations, and exact results.

One process per rank; ``--extra dp,pp,tp`` picks the layout (default 1,world,1). The runtime runs tiny float64
stages (two tensors cross each boundary: activations and an integer index) without Lightning, under:
- a recorder of every ``dist.new_group`` call made while the process groups are built, marked when it comes from
  the pipeline transport (a frame in ``lightning_3d.pipeline.p2p`` or ``ProcessGroups._pipeline_channels``);
- a recorder of the transport's operations (its ``PipelineChannels`` methods wrapped): device operations per batch,
  shape headers per message. Every rank's sequences are gathered, and the report says, for every pair of
  neighbours, whether one's sequence equals the other's with sends and receives swapped;
- a single-process reference (every rank computes the whole model) the gradients and losses must equal.

Steps: 1F1B with 3 micro-batches (where one rank's next receive and its neighbour's next send cross), GPipe with
micro-batches of two shapes (shape headers), an interleaved schedule with 2·pp micro-batches whose gradients travel
through a codec that splits each into two parts (posted ahead like any message; at pp = 3 the middle rank receives
from both neighbours in one round, so two messages share a batch), and a forward-only step. ``--extra cb`` instead runs
the strategy with compressed backpropagation at (1, 2, 1). ``L3D_TEST_DEVICE=cuda`` runs it on GPUs with NCCL.
"""

from __future__ import annotations

import inspect
import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from lightning_3d.distributed.parallel_dims import ParallelDims
from lightning_3d.distributed.process_groups import ProcessGroups
from lightning_3d.pipeline.codec import BoundaryKey
from lightning_3d.pipeline.p2p import PipelineChannels
from lightning_3d.pipeline.runtime import PipelineRuntime
from tests.scenarios.common import parse_args, write_report

H = 6
CUDA = os.environ.get("L3D_TEST_DEVICE", "cpu") == "cuda"


class Stage(nn.Module):
    def __init__(self, index: int, last: bool) -> None:
        super().__init__()
        self.index, self.last = index, last
        self.lin = nn.Linear(H, H, dtype=torch.float64)
        with torch.no_grad():
            g = torch.Generator().manual_seed(100 + index)
            self.lin.weight.copy_(torch.randn(H, H, generator=g, dtype=torch.float64) / H**0.5)
            self.lin.bias.copy_(torch.randn(H, generator=g, dtype=torch.float64) * 0.1)

    def forward(self, *inputs, microbatch):
        if inputs:
            x, idx = inputs
            assert torch.equal(idx.cpu(), torch.arange(x.shape[0])), "the index tensor arrived damaged"
        else:
            x = microbatch
        h = torch.tanh(self.lin(x))
        return h if self.last else (h, torch.arange(h.shape[0], device=h.device))


class SplitCodec:
    """A lossless codec of two parts per gradient (like CB's P and Q): the receiver sizes both from the key alone."""

    def message_metas(self, meta, key: BoundaryKey):
        n = torch.Size(meta[0]).numel()
        return [((n - n // 2,), meta[1]), ((n // 2,), meta[1])]

    def encode(self, grad, key):
        flat = grad.reshape(-1)
        n = flat.numel()
        return [flat[: n - n // 2].clone(), flat[n - n // 2 :].clone()]

    def decode(self, parts, meta, key):
        return torch.cat(parts).reshape(meta[0])


def loss_fn(output, mb):
    return output.pow(2).sum()


def record_groups():
    """Wrap ``dist.new_group``; returns the list it fills with (ranks, made by the transport)."""
    calls, original = [], dist.new_group

    def wrapper(*args, **kwargs):
        names = {(f.frame.f_globals.get("__name__"), f.function) for f in inspect.stack()[1:12]}
        transport = any(mod == "lightning_3d.pipeline.p2p" or fn == "_pipeline_channels" for mod, fn in names)
        ranks = kwargs.get("ranks", args[0] if args else None)
        calls.append((list(ranks) if ranks is not None else None, transport))
        return original(*args, **kwargs)

    dist.new_group = wrapper
    return calls, lambda: setattr(dist, "new_group", original)


def record_ops(channels: PipelineChannels, log: list) -> None:
    """Wrap this rank's transport: ("data", peer, batch ops) per device batch, ("header", peer, op) per header.
    A batch's ops are (op, shape, dtype string), in issue order."""
    def entry(op, tensor):
        return (op, tuple(tensor.shape), str(tensor.dtype))

    if hasattr(channels, "exchange"):
        exchange, send_h, recv_h = channels.exchange, channels.send_header, channels.recv_header

        def ex(sends, recvs):
            for peer in sorted({p for p, _ in sends + recvs}):
                log.append(("data", channels.peer(peer), [entry("send", t) for p, t in sends if p == peer]
                            + [entry("recv", t) for p, t in recvs if p == peer]))
            return exchange(sends, recvs)

        channels.exchange = ex
        channels.send_header = lambda p, metas: (log.append(("header", channels.peer(p), "send")), send_h(p, metas))[1]
        channels.recv_header = lambda p: (log.append(("header", channels.peer(p), "recv")), recv_h(p))[1]
    else:  # the transport before the ordered stream: one operation at a time, per (kind, direction) channel
        isend, irecv, send_h, recv_h = channels.isend, channels.irecv, channels.send_header, channels.recv_header
        channels.isend = lambda c, t: (log.append(("data", c.peer, [entry("send", t)])), isend(c, t))[1]
        channels.irecv = lambda c, t: (log.append(("data", c.peer, [entry("recv", t)])), irecv(c, t))[1]
        channels.send_header = lambda c, metas: (log.append(("header", c.peer, "send")), send_h(c, metas))[1]
        channels.recv_header = lambda c: (log.append(("header", c.peer, "recv")), recv_h(c))[1]


def matched(logs: list[list], a: int, b: int) -> dict:
    """Whether rank a's operations towards b mirror b's towards a: device batches one for one, headers per direction."""
    swap = {"send": "recv", "recv": "send"}
    mine = [sorted(ops) for kind, peer, ops in logs[a] if kind == "data" and peer == b]
    theirs = [sorted((swap[op], *rest) for op, *rest in ops) for kind, peer, ops in logs[b] if kind == "data" and peer == a]
    headers = all(
        [op for kind, peer, op in logs[x] if kind == "header" and peer == y and op == "send"]
        == [swap[op] for kind, peer, op in logs[y] if kind == "header" and peer == x and op == "recv"]
        for x, y in ((a, b), (b, a))
    )
    return {"pair": [a, b], "batches": len(mine), "data": mine == theirs, "headers": headers}


def reference(stages: list[Stage], mbs: list[torch.Tensor]):
    """Single-process loss (sum over micro-batches / total rows) and gradients of every stage."""
    for s in stages:
        s.zero_grad()
    total = sum(mb.shape[0] for mb in mbs)
    loss = 0
    for mb in mbs:
        x = mb
        for s in stages:
            out = s(*(x if isinstance(x, tuple) else ()), microbatch=mb)
            x = out
        loss = loss + loss_fn(x, mb)
    (loss / total).backward()
    return (loss / total).detach(), {s.index: [p.grad.clone() for p in s.parameters()] for s in stages}


def compressed_pipeline() -> None:
    """``--extra cb``: CB (+ LEP) on every gradient send of a (1, 2, 1) fit, through the strategy, equal to the
    uncompressed reference (full rank): compressed gradients posted ahead, on NCCL with ``L3D_TEST_DEVICE=cuda``."""
    from tests.scenarios.compression import exact_at_full_rank

    args = parse_args()
    write_report(args.report, exact_at_full_rank(1, 2, 1))


def main() -> None:
    args = parse_args()
    if args.extra == "cb":
        return compressed_pipeline()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if CUDA else torch.device("cpu")
    if CUDA:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if CUDA else "gloo", timeout=timedelta(seconds=120),
                            **({"device_id": device} if CUDA else {}))
    dp, pp, tp = map(int, args.extra.split(",")) if args.extra else (1, world, 1)
    dims = ParallelDims(dp, pp, tp, world)
    calls, restore = record_groups()
    try:
        groups = ProcessGroups(dims, rank, device, 2, timedelta(seconds=120))
    finally:
        restore()
    mine = [ranks for ranks, transport in calls if transport and (ranks is None or rank in ranks)]
    report = {"layout": [dp, pp, tp], "group_calls": len(calls),
              "transport_calls": sum(t for _, t in calls), "transport_member": len(mine)}
    channels = groups.channels
    channels.warmup()
    log: list = []
    record_ops(channels, log)
    g = torch.Generator().manual_seed(7)
    results = []
    for schedule, v, sizes, codec, train in (("1f1b", 1, [2, 2, 2], None, True), ("gpipe", 1, [2, 3], None, True),
                                             ("interleaved_1f1b", 2, [2] * (2 * pp), SplitCodec(), True),
                                             ("1f1b", 1, [3, 1, 3], None, False)):
        num_stages = pp * v
        stages = [Stage(s, s == num_stages - 1).to(device) for s in range(num_stages)]
        runtime = PipelineRuntime(
            {s: stages[s] for s in range(num_stages) if s % pp == groups.pp_rank}, num_stages=num_stages,
            pp_rank=groups.pp_rank, pp_size=pp, schedule=schedule, channels=channels, device=device,
            loss_fn=loss_fn, loss_terms_fn=lambda mb: mb.shape[0],
        )
        if codec is not None:
            runtime.codec = codec
        mbs = [torch.randn(n, H, generator=g, dtype=torch.float64).to(device) for n in sizes]
        loss = runtime.train_step(mbs) if train else runtime.eval_step(mbs)
        ref_stages = [Stage(s, s == num_stages - 1).to(device) for s in range(num_stages)]
        ref_loss, ref_grads = reference(ref_stages, mbs)
        ok = True
        if loss is not None:
            # The runtime sums the micro-batch losses in fp32: a few roundings of 2^-24 each, far below 1e-6.
            ok &= torch.allclose(loss.double(), ref_loss, rtol=1e-6, atol=0)
        if train:
            for s, stage in runtime.stages.items():
                # float64 stages, but the runtime's loss factor 1 / terms is an fp32 number: one rounding, 2^-24 relative.
                ok &= all(torch.allclose(p.grad, r, rtol=1e-6, atol=1e-12) for p, r in zip(stage.parameters(), ref_grads[s]))
        results.append({"schedule": schedule, "microbatches": sizes, "train": train, "codec": codec is not None, "exact": bool(ok)})
    logs: list = [None] * world
    dist.all_gather_object(logs, log)
    gathered: list = [None] * world
    dist.all_gather_object(gathered, {**report, "results": results})
    if rank == 0:
        pairs = []
        for d in range(dp):
            for t in range(tp):
                ranks = dims.pipeline_ranks(d, t)
                pairs += [matched(logs, ranks[i], ranks[(i + 1) % pp]) for i in range(pp if pp > 2 else 1)]
        write_report(args.report, {"ranks": gathered, "pairs": pairs})
    groups.destroy()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
