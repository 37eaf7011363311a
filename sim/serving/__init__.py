"""The serving room: the simulated inference server (simpy ``server``, ``scheduler``, KV managers
``kv``/``kv_groups``, ``pools``), its settings (``config``, ``choices``), the step-time model
and its calibration (``steptime``, ``step_fit``, ``engine_runs``), model/GPU/engine presets,
``simulate`` and ``tenants``. Builds on ``sim.replay``."""
