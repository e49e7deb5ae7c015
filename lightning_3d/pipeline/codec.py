"""How activation gradients travel between stages: the hook compressed backpropagation plugs into.

Both ends of a boundary call the codec with the same ``BoundaryKey`` and know the gradient's shape, so
the receiver can size its buffers for whatever the sender will send without extra messages.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from torch import Tensor

from lightning_3d.pipeline.p2p import TensorMeta


@dataclass(frozen=True)
class BoundaryKey:
    """The gradient sent by ``stage`` (to ``stage - 1``) for ``microbatch``; ``epilogue`` if in the drain.

    ``tensor`` numbers the floating-point tensors of one boundary (an encoder-decoder boundary carries two),
    so per-boundary state (error feedback, warm start) never mixes them.
    """

    stage: int
    microbatch: int
    epilogue: bool
    tensor: int = 0


class GradientCodec(Protocol):
    def message_metas(self, meta: TensorMeta, key: BoundaryKey) -> list[TensorMeta]:
        """Shapes and dtypes of the tensors that carry a gradient of shape/dtype ``meta``."""

    def encode(self, grad: Tensor, key: BoundaryKey) -> list[Tensor]:
        """Sender side: the tensors to send for ``grad``."""

    def decode(self, parts: list[Tensor], meta: TensorMeta, key: BoundaryKey) -> Tensor:
        """Receiver side: the gradient rebuilt from the received tensors."""


class IdentityCodec:
    """Send gradients as they are."""

    def message_metas(self, meta: TensorMeta, key: BoundaryKey) -> list[TensorMeta]:
        return [meta]

    def encode(self, grad: Tensor, key: BoundaryKey) -> list[Tensor]:
        return [grad]

    def decode(self, parts: list[Tensor], meta: TensorMeta, key: BoundaryKey) -> Tensor:
        return parts[0]
