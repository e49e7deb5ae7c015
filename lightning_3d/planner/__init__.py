"""planner (see DESIGN.md)."""
