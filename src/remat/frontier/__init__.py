"""remat.frontier (see DESIGN.md)."""
