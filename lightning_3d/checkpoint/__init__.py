"""Checkpoint I/O: what goes into a sharded checkpoint (``state``: DCP entries keyed by parameter name, so any
layout loads any other) and the files of its directory (``files``: reading without running code, atomic saves, the
manifest every load verifies). The strategy's ``sharded_io`` drives both; recipes and the export read them.
docs/architecture.md, "Checkpoints".
"""

from lightning_3d.checkpoint.files import META_FILE, check_dcp_metadata, safe_load, verify, write_manifest

__all__ = ["META_FILE", "check_dcp_metadata", "safe_load", "verify", "write_manifest"]
