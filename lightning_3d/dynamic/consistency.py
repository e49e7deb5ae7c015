"""Plan consistency across ranks, and the per-micro-batch recomputation flag: the two places where a dynamic plan
leaves the data path.

Every rank derives the same plan from (lengths, cost model, seed), without talking (docs/dynamic.md, Determinism).
If two ranks of one pipeline ever disagree (a different NumPy build or CPU breaking a tie differently), their sends
and receives no longer match: the pipeline hangs, or trains on mismatched activations. ``check_same_plan`` compares a
digest of a step's explicit schedule and micro-batch shapes across a group in one tiny all-reduce and raises the same
error on every rank of it, before the step's first send.

``RECOMPUTE_KEY``: the reserved micro-batch key by which a plan's ``MicroBatchPlan.recompute`` reaches the model
(the recipes' pipeline stages read it; docs/dynamic.md, Per-step recomputation).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from lightning_3d.pipeline.microbatch import signature

# A Python bool under this key of a micro-batch dict switches activation checkpointing on (True) or off (False) for
# that micro-batch, over the stage's default. A plain bool, not a tensor: Lightning's device transfer and the
# DataLoader's worker queue keep it as is, reading it needs no device synchronisation, and the pipeline's
# shape signature (tensors only) ignores it.
RECOMPUTE_KEY = "activation_checkpointing"

T = TypeVar("T")
_MASK = (1 << 62) - 1  # digests in [0, 2^62): the digest and its negation both fit an int64


def plan_digest(orders: Sequence[Sequence[Any]], microbatches: Sequence[Any]) -> int:
    """A digest of a step's schedule (each action's kind, stage and micro-batch; the runtime recomputes the rest)
    and of its micro-batches' tensor shapes and dtypes (and recomputation flags), equal on every rank that holds
    the same step. blake2b over a canonical text: Python's ``hash`` of strings differs between processes."""
    actions = [[(a.kind, a.stage, a.microbatch) for a in order] for order in orders]
    shapes = [[(shape, str(dtype)) for shape, dtype in signature(mb)] for mb in microbatches]
    flags = [mb.get(RECOMPUTE_KEY) if hasattr(mb, "get") else None for mb in microbatches]
    text = repr((actions, shapes, flags)).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") & _MASK


def check_same_plan(
    orders: Sequence[Sequence[Any]], microbatches: Sequence[Any], group: dist.ProcessGroup | None,
    device: torch.device, where: str = "",
) -> None:
    """Raise ``RuntimeError`` on every rank of ``group`` if its ranks hold different schedules or micro-batch shapes.

    One all-reduce (MAX) of (digest, -digest): all equal exactly when max(digest) == -max(-digest) == min(digest).
    ``device``: CPU for a gloo group (no device synchronisation), the rank's device for NCCL (reading the verdict
    then waits for the device's queued work, once per step with explicit orders). ``where``: the group's name in
    the message."""
    if group is None or dist.get_world_size(group) == 1:
        return
    digest = plan_digest(orders, microbatches)
    pair = torch.tensor([digest, -digest], dtype=torch.int64, device=device)
    dist.all_reduce(pair, op=dist.ReduceOp.MAX, group=group)
    high, low = int(pair[0]), -int(pair[1])
    if high != low:
        raise RuntimeError(
            f"Compressed3DStrategy: the ranks of {where or 'one pipeline'} hold different plans for this step: their"
            f" digests of the explicit schedule (MicroBatches.orders) and micro-batch shapes range from {low:#x} to"
            f" {high:#x} (this rank's: {digest:#x}), so their pipeline sends and receives would not match. Every rank"
            " must derive the same plan from the same global batch: run the same software (NumPy and torch builds)"
            " on the same kind of CPU on every node, give every rank the same data, cost model and seed, or compute"
            " the plan on one rank and broadcast it (docs/dynamic.md, Determinism)."
        )


def with_microbatch_checkpointing(module: Any, microbatch: Any, run: Callable[[], T]) -> T:
    """``run()`` with ``module.activation_checkpointing`` set from the micro-batch's ``RECOMPUTE_KEY`` when it has
    one that differs (restored afterwards), else as is: one dict lookup when the key is absent. Checkpointing
    (non-reentrant) recomputes from the function it was given during backward, so the restored setting does not
    change how this micro-batch's backward runs."""
    wanted = microbatch.get(RECOMPUTE_KEY) if isinstance(microbatch, Mapping) else None
    if wanted is None or bool(wanted) == module.activation_checkpointing:
        return run()
    default, module.activation_checkpointing = module.activation_checkpointing, bool(wanted)
    try:
        return run()
    finally:
        module.activation_checkpointing = default
