"""Placement: where engine processes run and who restarts them (local processes: entrypoints/launch.py; Ray: here)."""
