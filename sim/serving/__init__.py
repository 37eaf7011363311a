"""The serving room: the simulated inference server (simpy ``server``, ``scheduler``, KV managers
``kv``/``kv_groups``, ``pools``), its settings (``config``, ``choices``), the step-time model
and its calibration (``steptime``, ``step_fit``, ``engine_runs``), engine presets, ``simulate``,
``engine_compare`` (a real engine's run against ``simulate``) and ``tenants``. Builds on
``sim.replay``, which holds the model/GPU presets and the serving columns ``realgpu`` shares."""
