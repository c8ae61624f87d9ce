"""Placement: where engine processes run and who restarts them (local processes: frontend/launch.py; Ray: here)."""
