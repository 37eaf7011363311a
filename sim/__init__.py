"""Replay and simulation on top of ``policies`` and ``traces``; owner of the report schema."""
