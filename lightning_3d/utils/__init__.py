"""Leaf helpers shared by every layer: communication byte accounting and small tensor utilities.

This package sits at the bottom of the import layering (docs/architecture.md): it imports only torch and the
standard library, so pipeline, compression, strategies, callbacks and recipes may all use it.
"""
