"""remat.apply (see DESIGN.md)."""
