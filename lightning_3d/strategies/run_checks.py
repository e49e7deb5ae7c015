"""Checks of the run's settings that ``Compressed3DStrategy`` reads from the Trainer and its environment (precision,
gradient clipping, the process-group backend against the device), run on every rank in ``setup_environment`` before
the first process group exists, so a bad value is one clear error on every rank instead of torch's or Lightning's
error from deep inside setup (or, for a negative clipping norm, silently wrong training).
"""

from __future__ import annotations

from typing import Any

import torch

from lightning_3d.distributed.grad_sync import DEFAULT_BUCKET_SIZE_MB

SUPPORTED_PRECISION = ("32-true", "bf16-mixed", "bf16-true")


def check_precision(precision: str) -> None:
    if precision in ("16-mixed", "16"):
        # fp16 needs loss scaling (a GradScaler): its scale would have to be one value for every pipeline stage and
        # tensor shard, and its unscale/inf checks would have to see the whole model, which Lightning's GradScaler
        # (one process's parameters) does not; bf16 has fp32's range and needs no scaling.
        raise ValueError(
            f"Compressed3DStrategy does not support precision={precision!r} (fp16 with loss scaling: the scale and its"
            " overflow checks would have to span every pipeline stage and tensor shard). Use precision='bf16-mixed'"
            " (same speed on GPUs with bf16, no loss scaling needed) or '32-true'."
        )
    if precision not in SUPPORTED_PRECISION:
        raise ValueError(
            f"Compressed3DStrategy does not support precision={precision!r}; use one of {', '.join(SUPPORTED_PRECISION)}."
        )


def check_gradient_clipping(trainer: Any) -> None:
    """Lightning accepts any number; a negative norm would flip the gradients' sign instead of clipping them."""
    value = getattr(trainer, "gradient_clip_val", None)
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise ValueError(
            f"Trainer(gradient_clip_val={value!r}) must be a number >= 0 (the largest gradient norm, or value with"
            " gradient_clip_algorithm='value'; 0 or None: no clipping). Pass e.g. gradient_clip_val=1.0."
        )


def check_backend(backend: str | None, device: torch.device) -> None:
    """``process_group_backend`` against the run's device: torch's own error for NCCL without CUDA comes from inside
    ``init_process_group`` (or later, at the first collective), and names neither the option nor the fix."""
    if backend is None:
        return
    if not isinstance(backend, str):
        raise TypeError(f"`process_group_backend={backend!r}` must be a backend name such as 'nccl' or 'gloo'.")
    if backend.strip().lower() == "nccl" and device.type != "cuda":  # "cpu:gloo,cuda:nccl" names a CPU backend too
        why = ("this machine has no usable CUDA GPU" if not torch.cuda.is_available()
               else f"the run's devices are {device.type} (accelerator={device.type!r})")
        raise ValueError(
            f"process_group_backend={backend!r} needs CUDA devices, but {why}. Use process_group_backend='gloo' on"
            " CPU, or leave it unset (gloo on CPU, nccl on GPUs)."
        )


def check_run(module: Any, precision: str, backend: str | None, device: torch.device) -> None:
    """Every check above, in the order a user would fix them (``module``: the LightningModule, maybe not attached to
    a Trainer)."""
    check_precision(precision)
    check_backend(backend, device)
    try:
        trainer = module.trainer
    except (RuntimeError, AttributeError):
        return
    check_gradient_clipping(trainer)


def check_bucket_size(bucket_size_mb: Any) -> None:
    if isinstance(bucket_size_mb, bool) or not isinstance(bucket_size_mb, (int, float)) or not bucket_size_mb > 0:
        raise ValueError(
            f"`bucket_size_mb={bucket_size_mb!r}` must be a size in MiB > 0 (gradients are all-reduced in buckets of"
            f" about this size; the default is {DEFAULT_BUCKET_SIZE_MB:g})."
        )
