"""The context-parallel options of a run (size, layout, attention kind), validated before any process group exists.

The strategy's ``ParallelismConfig`` (``context_parallel_size``, ``context_parallel_layout``,
``context_parallel_attention``) builds one ``ContextParallelConfig`` with ``context_parallel_config``; the checks are
pure, so every rank raises the
same error before the first collective. See docs/context_parallel.md.
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_3d.context.sharding import LAYOUTS

ATTENTIONS = ("ring", "ulysses")


@dataclass(frozen=True)
class ContextParallelConfig:
    """``size`` cp ranks share every sequence, each holding its ``layout`` slice; attention by ``attention``
    (``"ring"``: K/V passed around the cp ranks; ``"ulysses"``: all-to-alls over heads, which must divide by cp)."""

    size: int = 1
    layout: str = "zigzag"
    attention: str = "ring"

    @property
    def enabled(self) -> bool:
        return self.size > 1


def context_parallel_config(size: int = 1, layout: str = "zigzag", attention: str = "ring") -> ContextParallelConfig:
    """Validate the options, raising a ValueError that names the bad value and the accepted ones."""
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"`context_parallel_size={size!r}` must be a positive integer (1: no context parallelism).")
    if layout not in LAYOUTS:
        raise ValueError(f"`context_parallel_layout={layout!r}` must be one of {LAYOUTS} ('zigzag' balances causal"
                         " attention's work over the cp ranks).")
    if attention not in ATTENTIONS:
        raise ValueError(f"`context_parallel_attention={attention!r}` must be one of {ATTENTIONS}.")
    return ContextParallelConfig(size, layout, attention)
