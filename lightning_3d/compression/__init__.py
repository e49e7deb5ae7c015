"""compression (see DESIGN.md)."""
