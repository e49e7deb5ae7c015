"""Known GPUs (for ``DeviceSpec``) and the cluster description a plan targets (nodes × GPUs, links, memory).

A plan can target machines it is not running on: ``ClusterSpec.load`` reads a small YAML/JSON file (safe loaders
only, no code runs), and ``device_spec("h100")`` fills the per-GPU numbers from the table below (dense bf16 peaks from
``lightning_3d.utils.peak_flops``, not the sparse figures). docs/planner.md shows the file format.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import yaml

from lightning_3d.costs.model import DeviceSpec
from lightning_3d.utils.peak_flops import dense_peak_flops

GB = 1e9
GIB = 2**30

#: name -> (dense bf16 FLOP/s, HBM bytes/s, memory bytes, NVLink bytes/s per GPU per direction)
KNOWN_DEVICES: dict[str, tuple[float, float, float, float]] = {
    "h100": (dense_peak_flops("h100"), 3.35e12, 80 * GIB, 450 * GB),
    "h200": (dense_peak_flops("h200"), 4.8e12, 141 * GB, 450 * GB),
    "a100": (dense_peak_flops("a100"), 2.039e12, 80 * GIB, 300 * GB),
}
_ALIASES = {"nvidia h100": "h100", "h100 80gb hbm3": "h100", "nvidia h200": "h200", "nvidia a100": "a100"}


def _key(name: str) -> str | None:
    low = name.lower().strip()
    for alias, key in _ALIASES.items():
        if low.startswith(alias):
            return key
    for key in KNOWN_DEVICES:
        if key in low:
            return key
    return None


def device_spec(name: str, *, gemm_efficiency: float = 0.7) -> DeviceSpec:
    """The ``DeviceSpec`` of a known GPU by name ("h100", "NVIDIA H100 80GB HBM3", "a100", ...)."""
    key = _key(name)
    if key is None:
        raise ValueError(f"Unknown device {name!r}: known are {sorted(KNOWN_DEVICES)}; give a DeviceSpec(...) or a"
                         f" cluster file with peak_flops, memory_bandwidth and memory_bytes instead.")
    flops, bandwidth, memory, _ = KNOWN_DEVICES[key]
    return DeviceSpec(key, flops, bandwidth, memory, gemm_efficiency)


def nvlink_bandwidth(name: str) -> float | None:
    key = _key(name)
    return KNOWN_DEVICES[key][3] if key is not None else None


@dataclass(frozen=True)
class ClusterSpec:
    """Machines a plan targets. Bandwidths are bytes/s per GPU in one direction (what a ring collective's bus
    bandwidth approaches); ``memory_per_gpu`` defaults to the device's. ``latency``: seconds per message."""

    nodes: int
    gpus_per_node: int
    device: DeviceSpec
    intra_node_bandwidth: float
    inter_node_bandwidth: float
    memory_per_gpu: float = 0.0
    latency: float = 10e-6
    extra: dict = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        for name in ("nodes", "gpus_per_node"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"cluster {name}={value!r} must be a positive integer.")
        for name in ("intra_node_bandwidth", "inter_node_bandwidth"):
            if not getattr(self, name) > 0:
                raise ValueError(f"cluster {name}={getattr(self, name)!r} must be a bandwidth in bytes/s > 0.")
        if not self.memory_per_gpu:
            object.__setattr__(self, "memory_per_gpu", float(self.device.memory_bytes))

    @property
    def num_gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    def bandwidth(self, group_size: int, stride: int = 1) -> float:
        """Bus bandwidth of a group of ``group_size`` ranks ``stride`` apart: inter-node once it spans nodes."""
        return self.intra_node_bandwidth if group_size * stride <= self.gpus_per_node else self.inter_node_bandwidth

    @classmethod
    def single_node(cls, gpus: int, device: DeviceSpec | str = "h100", inter_node_bandwidth: float = 50 * GB) -> ClusterSpec:
        spec = device_spec(device) if isinstance(device, str) else device
        intra = nvlink_bandwidth(spec.name) or 100 * GB
        nodes, per_node = (1, gpus) if gpus <= 8 else (-(-gpus // 8), 8)
        if nodes * per_node != gpus:
            raise ValueError(f"{gpus} GPUs do not fill nodes of 8; give a cluster file (--cluster) with nodes and gpus_per_node.")
        return cls(nodes, per_node, spec, intra, inter_node_bandwidth)

    @classmethod
    def from_dict(cls, data: dict) -> ClusterSpec:
        data = dict(data)
        device = data.pop("device", "h100")
        if isinstance(device, dict):
            known = {f.name for f in fields(DeviceSpec)}
            bad = sorted(set(device) - known)
            if bad:
                raise ValueError(f"cluster device has unknown keys {bad}; allowed: {sorted(known)}.")
            device = DeviceSpec(**device)
        elif isinstance(device, str):
            device = device_spec(device)
        else:
            raise ValueError(f"cluster device={device!r} must be a known name or a mapping of DeviceSpec fields.")
        scale = {"intra_node_gbps": "intra_node_bandwidth", "inter_node_gbps": "inter_node_bandwidth",
                 "memory_per_gpu_gb": "memory_per_gpu"}
        for given, name in scale.items():
            if given in data:
                data[name] = float(data.pop(given)) * GB
        if "intra_node_bandwidth" not in data:
            data["intra_node_bandwidth"] = nvlink_bandwidth(device.name) or 100 * GB
        data.setdefault("inter_node_bandwidth", 50 * GB)
        allowed = {f.name for f in fields(cls)} - {"device", "extra"}
        bad = sorted(set(data) - allowed)
        if bad:
            raise ValueError(f"cluster file has unknown keys {bad}; allowed: {sorted(allowed | set(scale) | {'device'})}.")
        return cls(device=device, **data)

    @classmethod
    def load(cls, path: str | Path) -> ClusterSpec:
        """Read a cluster file (YAML or JSON; safe loaders)."""
        text = Path(path).read_text()
        data = json.loads(text) if str(path).endswith(".json") else yaml.safe_load(text)
        if not isinstance(data, dict):
            raise ValueError(f"cluster file {path} must hold a mapping (nodes, gpus_per_node, device, ...).")
        return cls.from_dict(data)

    def to_dict(self) -> dict:
        out = asdict(self)
        out.pop("extra")
        return out
