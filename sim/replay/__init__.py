"""The replay room: the one replay loop (``engine``), the cost model (``costs``), the pool monitor
(``metrics``), the report schema every backend writes (``schema``; its serving columns and the
request table: ``serving_metrics``), the model and GPU presets (``models``, ``hardware``), trace
replay (``trace_replay``), bounds, fidelity against PyTorch's recorded decisions, the layout
recorder, progress bars. Imports ``policies`` and ``traces``, no other room."""

# ``sim.replay`` was one module (now ``sim.replay.trace_replay``) before sim/ had rooms: its names
# stay importable from here (``from sim.replay import replay``), loaded on first use so that
# importing one module of the room imports no other.
from sim import _reexporting_getattr

__getattr__ = _reexporting_getattr(__name__, __path__, "sim.replay.trace_replay")
