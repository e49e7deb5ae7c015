"""Compressed3DStrategy and its parts: the mesh, stage building, gradient synchronisation, checkpoints."""
