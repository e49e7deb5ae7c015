"""dynamic (see DESIGN.md)."""
