"""Replaying a job trace through a policy without Ray: ``trace`` (the format, seeded
heavy-tailed traces), ``replay`` (the discrete-event replay) and ``report`` (what a replay
returns, and the figures per policy)."""
