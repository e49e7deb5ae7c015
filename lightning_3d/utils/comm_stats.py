"""Bytes on the wire per kind of traffic, before and after compression.

Counted on the host from tensor shapes (no device synchronisation), as the payload each rank contributes:
the tensors it sends point-to-point, or its input to a collective. Ring algorithms move a multiple of that
(about 2(n-1)/n for an all-reduce); the ratios between kinds and between compressed and uncompressed runs
are what the counters are for.
"""

from __future__ import annotations

from dataclasses import dataclass, field

KINDS = ("forward_activations", "backward_activation_grads", "dp_gradients", "embedding_sync")


@dataclass
class Counter:
    before: int = 0  # bytes an uncompressed run would send
    after: int = 0  # bytes actually sent


@dataclass
class CommunicationStats:
    """Cumulative counters per kind plus the counters of the last completed training step."""

    total: dict[str, Counter] = field(default_factory=lambda: {k: Counter() for k in KINDS})
    step: dict[str, Counter] = field(default_factory=lambda: {k: Counter() for k in KINDS})
    last_step: dict[str, Counter] = field(default_factory=lambda: {k: Counter() for k in KINDS})

    def add(self, kind: str, before: int, after: int | None = None) -> None:
        after = before if after is None else after
        for table in (self.total, self.step):
            table[kind].before += before
            table[kind].after += after

    def end_step(self) -> None:
        self.last_step = self.step
        self.step = {k: Counter() for k in KINDS}

    def as_dict(self, which: str = "total") -> dict[str, dict[str, int]]:
        table = {"total": self.total, "last_step": self.last_step}[which]
        return {k: {"bytes_before": c.before, "bytes_after": c.after} for k, c in table.items()}

    def state_dict(self) -> dict:
        return {"total": self.as_dict("total")}

    def load_state_dict(self, state: dict) -> None:
        for kind, values in state["total"].items():
            self.total[kind] = Counter(values["bytes_before"], values["bytes_after"])


def nbytes(shape: tuple[int, ...], element_size: int) -> int:
    count = 1
    for d in shape:
        count *= d
    return count * element_size
