"""remat.receipt (see DESIGN.md)."""
