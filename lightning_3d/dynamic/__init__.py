"""Dynamic micro-batching (DynaPipe-style): not built yet; docs/architecture.md describes where it will plug in."""
