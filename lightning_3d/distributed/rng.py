"""Random streams for dropout under data x pipeline x tensor parallelism (the job of Megatron-LM's RNG tracker).

Every rank has two streams:

- The default stream: torch's own CPU and CUDA generators, which :func:`seed_parallel_rng` seeds from (seed,
  dp_rank, pp_rank). It is the same on the tensor-parallel ranks of one stage and different across replicas (other
  samples) and pipeline ranks (other layers: layer k on pipeline rank 1 must not reuse the masks of layer 0 on rank
  0). Dropout on activations that are replicated over tp (the residual stream without sequence parallelism, the
  embeddings) draws from it, so those tensors stay bitwise equal on all tp ranks, as DTensor's ``Replicate``
  assumes.
- The tensor-parallel region, entered with :func:`tensor_parallel_region`: dropout on activations that are sharded
  over tp (the attention probabilities of a rank's own heads, a column-sharded hidden layer, the sequence-sharded
  residual under sequence parallelism) draws there, so every tp rank gets its own masks.

The region keeps no state of its own. On entry it draws one number from the default CPU generator (the same draw on
every tp rank, so the default stream stays in step), mixes it with this rank's key of (seed, dp, pp, tp) and reseeds
the device's default generator with the result for the duration of the block, restoring the generator's state on
exit. Its masks are therefore a function of the default CPU generator's state, which ``torch.utils.checkpoint``
stashes and restores around the recomputation: activation checkpointing recomputes exactly the masks of the first
forward, with no extra state to save (Megatron needs its own checkpoint function for its tracker's states).

Dynamo cannot trace the generator swap, so under ``torch.compile`` enter the region through
:func:`in_tensor_parallel_region`, which compiled code calls eagerly (a graph break around that one call; the
recipes do so only when dropout is on in training and the streams are seeded).

Outside :class:`~lightning_3d.Compressed3DStrategy` (nothing seeded here: single device, DDP) there is one stream
and the region does nothing.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn

# The base seed when ``lightning.seed_everything`` was not called (Megatron-LM's default seed).
DEFAULT_SEED = 1234
_MASK63 = (1 << 63) - 1
_MASK64 = (1 << 64) - 1

_region_key: int | None = None  # this rank's (seed, dp, pp, tp) key; None: not seeded, the region is a no-op
_region_device: torch.device | None = None


def base_seed() -> int:
    """Lightning's global seed (``seed_everything`` exports it as ``PL_GLOBAL_SEED``), else :data:`DEFAULT_SEED`."""
    value = os.environ.get("PL_GLOBAL_SEED")
    if value is None:
        return DEFAULT_SEED
    try:
        return int(value)
    except ValueError:
        raise ValueError(
            f"PL_GLOBAL_SEED={value!r} is not an integer; set it with `lightning.seed_everything(<int>)` or unset it."
        ) from None


def _derive(seed: int, *parts: object) -> int:
    """A 63-bit seed from the base seed and a name: unrelated streams for unrelated ranks (no ``seed + 100 * pp``
    arithmetic, where data-parallel rank 10 would reuse pipeline rank 1's stream)."""
    digest = hashlib.sha256(":".join(map(str, (seed, *parts))).encode()).digest()
    return int.from_bytes(digest[:8], "little") & _MASK63


def seed_parallel_rng(dp_rank: int, pp_rank: int, tp_rank: int, device: torch.device | str = "cpu",
                      seed: int | None = None) -> None:
    """Seed this rank's default stream from (seed, dp, pp) and its tensor-parallel region from (seed, dp, pp, tp).

    ``seed`` defaults to :func:`base_seed`. ``device`` is the device whose generator the region swaps when
    :func:`tensor_parallel_region` is not told one. Seeds torch's generators only (Python's and NumPy's are left
    to ``seed_everything``).
    """
    global _region_key, _region_device
    seed = base_seed() if seed is None else seed
    _check_device(torch.device(device))
    torch.manual_seed(_derive(seed, "default", dp_rank, pp_rank))  # the CPU and every CUDA generator
    _region_key = _derive(seed, "tensor-parallel", dp_rank, pp_rank, tp_rank)
    _region_device = torch.device(device)


def is_seeded() -> bool:
    """Whether :func:`seed_parallel_rng` ran in this process (else the region is a no-op: one stream)."""
    return _region_key is not None


def _check_device(device: torch.device) -> None:
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"The tensor-parallel random stream supports CPU and CUDA devices, not {device}.")


def _device_generator(device: torch.device) -> torch.Generator:
    _check_device(device)
    if device.type == "cpu":
        return torch.default_generator
    index = device.index if device.index is not None else torch.cuda.current_device()
    return torch.cuda.default_generators[index]


def _splitmix64(x: int) -> int:
    """A bijective 64-bit mixer: draws that differ in one bit give unrelated seeds."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


@contextlib.contextmanager
def tensor_parallel_region(device: torch.device | str | None = None, enabled: bool = True) -> Iterator[None]:
    """Random ops inside draw from this tensor-parallel rank's own stream (dropout on tp-sharded activations).

    ``device``: where the random ops run (default: the device given to :func:`seed_parallel_rng`). A no-op when
    ``enabled`` is False or nothing was seeded. The default stream advances by one draw of the CPU generator per
    entry, identically on every tp rank; the device's generator is left as it was.
    """
    if not enabled or _region_key is None:
        yield
        return
    device = _region_device if device is None else torch.device(device)
    # From the CPU generator on CUDA runs too: torch.utils.checkpoint always stashes the CPU state, and a CPU draw
    # does not synchronise with the GPU.
    draw = int(torch.empty((), dtype=torch.int64, device="cpu").random_().item())
    generator = _device_generator(device)
    saved = generator.get_state()
    generator.manual_seed(_splitmix64(draw ^ _region_key) & _MASK63)
    try:
        yield
    finally:
        generator.set_state(saved)


@torch.compiler.disable
def in_tensor_parallel_region(fn: Callable[..., Tensor], *args: object, device: torch.device | str | None = None,
                              **kwargs: object) -> Tensor:
    """``fn(*args, **kwargs)`` inside :func:`tensor_parallel_region`; run eagerly from compiled code."""
    with tensor_parallel_region(device):
        return fn(*args, **kwargs)


class ParallelDropout(nn.Dropout):
    """``nn.Dropout`` whose mask comes from the tensor-parallel region when its input is sharded over tp.

    ``sharded``: set by the recipes for inputs that are tp-sharded (always, or under sequence parallelism only);
    replicated inputs keep the default stream, whose masks are the same on every tp rank.
    """

    def __init__(self, p: float = 0.5, sharded: bool = False) -> None:
        super().__init__(p)
        self.sharded = sharded

    def forward(self, x: Tensor) -> Tensor:
        if self.sharded and self.training and self.p > 0 and is_seeded():
            return in_tensor_parallel_region(F.dropout, x, self.p, True, self.inplace, device=x.device)
        return super().forward(x)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, sharded={self.sharded}"
