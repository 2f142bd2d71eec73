"""Trace replay and serving simulation (see DESIGN.md sections 1 and 5)."""
