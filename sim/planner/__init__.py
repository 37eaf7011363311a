"""The planner room: how much KV an engine can allocate, from its start-up snapshot (``plan``,
``startup_kv``). Builds on ``sim.replay`` (fidelity) and ``sim.serving`` (model and engine
presets)."""
