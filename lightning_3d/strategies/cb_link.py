"""Whether compressed backpropagation (CB) runs: decided by the pipeline link, measured once at setup, as SC is by
the data-parallel link (``compression_state.py``).

CB trades validation loss for time on the activation-gradient sends of the schedule's cool-down. Where the pipeline
link is fast (NVLink inside a node) those sends are short next to a stage's backward: compressing them saves no time
and still costs loss (benchmarks/RESULTS.md). So with ``compressed_backprop="auto"`` (the default) the strategy
times one all-reduce over each pipeline's ranks (bus bandwidth, GB/s, the slowest pipeline deciding for all) and
runs CB only below ``cb_max_link_gbps``. The decision is logged once, recorded in checkpoints
(``checkpoint["compressed_3d"]``: ``pp_link_gbps``, ``cb_max_link_gbps``, ``cb_on``) and a resumed run decides by
the recorded measurement, so a job keeps compressing (or not) across restarts on another host. ``True`` / ``False``
decide without measuring. The functions take the strategy's ``CompressionState`` (its ``config``,
``pipeline_link_probe`` and ``pipeline_link_gbps``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_3d.distributed.parallel_dims import ParallelDims


def decides_cb_by_link(state: Any, dims: ParallelDims) -> bool:
    """Whether this run measures the pipeline link for CB (compression on, pp > 1, ``compressed_backprop="auto"``)."""
    cfg = state.config
    return cfg.enabled and dims.pp > 1 and cfg.compressed_backprop == "auto"


def compresses_backprop(state: Any, dims: ParallelDims) -> bool:
    """Whether CB compresses this job's activation gradients (the same answer on every rank, once set up)."""
    cfg = state.config
    return cfg.enabled and dims.pp > 1 and cfg.cb_on_link(state.pipeline_link_gbps)


def measure_pipeline_link(state: Any, dims: ParallelDims, pp_group: dist.ProcessGroup, device: torch.device) -> None:
    """Time one all-reduce on every pipeline's group at once, once; the slowest decides for every rank (a minimum over
    the world), so all ranks agree. Only where the answer matters (``decides_cb_by_link``). Collective."""
    if state.pipeline_link_gbps is not None or not decides_cb_by_link(state, dims):
        return
    measured = torch.tensor([float(state.pipeline_link_probe(pp_group, device))], device=device)
    dist.all_reduce(measured, op=dist.ReduceOp.MIN)
    state.pipeline_link_gbps = float(measured)
    _report(state, dims, "measured at setup")


def _report(state: Any, dims: ParallelDims, source: str) -> None:
    # A warning, not info: the same configuration trains differently on another host.
    on = compresses_backprop(state, dims)
    verdict = "on: slower than" if on else "off (exact activation gradients): at or above"
    rank_zero_warn(
        f"Compressed3DStrategy: the pipeline link runs at {state.pipeline_link_gbps:.1f} GB/s (bus bandwidth of an"
        f" all-reduce over a pipeline's ranks, {source}); compressed backpropagation is {verdict}"
        f" cb_max_link_gbps={state.config.cb_max_link_gbps:g}. Checkpoints record this measurement and a resumed run"
        " keeps it. Pass compressed_backprop=True or False to choose yourself."
    )


def cb_record(state: Any, dims: ParallelDims) -> dict[str, Any]:
    """What decided CB in this run, for the checkpoint."""
    return {"pp_link_gbps": state.pipeline_link_gbps, "cb_max_link_gbps": float(state.config.cb_max_link_gbps),
            "cb_on": compresses_backprop(state, dims)}


def restore_cb_record(state: Any, dims: ParallelDims, record: dict[str, Any] | None) -> bool:
    """Take the pipeline-link measurement the checkpointed run decided by, not this run's own. Returns whether that
    changes whether CB runs (the caller then installs the other codec). Where this run does not decide by the link
    (``compressed_backprop`` True or False, pp = 1, compression off) the configuration decides, as it says."""
    if not record or record.get("pp_link_gbps") is None or not decides_cb_by_link(state, dims):
        return False
    recorded = float(record["pp_link_gbps"])
    if recorded == state.pipeline_link_gbps:
        return False
    before = compresses_backprop(state, dims)
    state.pipeline_link_gbps = recorded
    _report(state, dims, "recorded in the checkpoint; the resumed run keeps it")
    return compresses_backprop(state, dims) != before
