"""remat.verify (see DESIGN.md)."""
