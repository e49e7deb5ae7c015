"""Leaf helpers shared by every layer: communication byte accounting, small tensor utilities and the one module
(``compat``) through which the package touches private torch and Lightning APIs.

This package sits at the bottom of the import layering (docs/architecture.md): it imports only torch, Lightning and
the standard library, so pipeline, compression, strategies, callbacks and recipes may all use it.
"""
