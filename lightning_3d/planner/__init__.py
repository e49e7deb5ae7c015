"""The parallelism planner (Aceso-style): not built yet; docs/architecture.md describes where it will plug in."""
