"""Callbacks for Compressed3DStrategy runs: error-feedback state, compression diagnostics, communication,
throughput/MFU and pipeline timelines (see docs/architecture.md). All take plain typed arguments (usable from YAML)."""

from lightning_3d.callbacks.comm_monitor import CommunicationMonitor
from lightning_3d.callbacks.diagnostics import CompressionDiagnostics
from lightning_3d.callbacks.ef_state import CompressionStateMonitor
from lightning_3d.callbacks.progress import ParallelModelSummary, StepProgressBar
from lightning_3d.callbacks.throughput import ThroughputMFUMonitor
from lightning_3d.callbacks.timeline import PipelineTimeline

__all__ = ["CommunicationMonitor", "CompressionDiagnostics", "CompressionStateMonitor", "ParallelModelSummary", "PipelineTimeline",
           "StepProgressBar", "ThroughputMFUMonitor"]
