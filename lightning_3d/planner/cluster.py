"""The cluster a plan targets when no cluster file is given: the profiled GPU, ``nodes`` nodes of it, and the links of
a named regime (``lightning-3d plan --nodes 2 --regime ib``): a prediction for machines the profile was not measured
on, from a one-node profile plus link figures (docs/planner.md, "Another cluster: --nodes and --regime").

The regimes are benchmarks/CONVENTIONS.md's ("Link regimes"), by the bus bandwidth of an all-reduce measured in each:
``nvlink`` the GPUs of one node, ``ib`` 200 Gb/s InfiniBand between nodes, ``ethernet`` 25-30 Gb/s Ethernet. The
planner uses one figure per link for its collectives and its pipeline sends alike. On one node a regime sets every
link (the benchmarks' one-host regimes switch NCCL's direct transports off for all GPUs); on several nodes it sets the
link between nodes, and the GPUs of a node keep NVLink (the profile's measured bus bandwidth where it has one, else
the device's figure). Several nodes without a regime: the cluster file's default between nodes (``inter_node_gbps``,
50 GB/s per GPU: 400 Gb/s InfiniBand).
"""

from __future__ import annotations

from lightning_3d.costs import ClusterSpec, DeviceSpec
from lightning_3d.costs.devices import GB, nvlink_bandwidth

#: all-reduce bus bandwidth of each link regime, GB/s (benchmarks/CONVENTIONS.md, "Link regimes"); None: NVLink, the
#: device's own figure (or the profile's measurement)
REGIME_GBPS: dict[str, float | None] = {"nvlink": None, "ib": 25.0, "ethernet": 3.8}
#: between nodes without a regime: what a cluster file assumes without ``inter_node_gbps`` (costs/devices.py)
DEFAULT_INTER_NODE = 50 * GB


def check_regime(regime: str | None) -> None:
    if regime is not None and regime not in REGIME_GBPS:
        raise ValueError(f"regime={regime!r} is not a link regime; choose one of {', '.join(map(repr, REGIME_GBPS))}"
                         " (benchmarks/CONVENTIONS.md, 'Link regimes').")


def cluster_for(gpus: int, device: DeviceSpec, *, nodes: int | None = None, regime: str | None = None,
                nvlink: float | None = None) -> ClusterSpec:
    """``nodes`` nodes of ``device`` holding ``gpus`` GPUs, linked as ``regime`` says (module docstring). ``nvlink``:
    the intra-node bus bandwidth in bytes/s (a profile's measurement), else the device's NVLink figure."""
    check_regime(regime)
    n = 1 if nodes is None else nodes
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"nodes={nodes!r} must be a positive integer (--nodes).")
    if gpus % n:
        raise ValueError(f"gpus={gpus} cannot be shared out over nodes={n}: give a GPU count that is a multiple of the"
                         " node count (the same GPUs per node).")
    fast = nvlink or nvlink_bandwidth(device.name) or 100 * GB
    if regime is None:
        link = DEFAULT_INTER_NODE if n > 1 else fast
    else:
        figure = REGIME_GBPS[regime]
        link = fast if figure is None else figure * GB
    intra = link if n == 1 else fast
    return ClusterSpec(n, gpus // n, device, intra, link)
