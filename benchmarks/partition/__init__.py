"""Partitioners: per-block profiles, and the slowest stage under profile, uniform and parameters."""
