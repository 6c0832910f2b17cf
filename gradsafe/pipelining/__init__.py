"""Corrected split backward for pipeline schedules (not implemented yet)."""
