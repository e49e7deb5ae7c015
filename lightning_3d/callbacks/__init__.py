"""callbacks (see DESIGN.md)."""
