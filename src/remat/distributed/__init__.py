"""remat.distributed (see DESIGN.md)."""
