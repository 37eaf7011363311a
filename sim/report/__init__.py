"""The report room: the HTML report (``html``), its interactive page, the figures (``plots``) and
the bounded table reads they draw from. Reads result folders in the schema of
``sim.replay.schema``."""

# ``sim.report`` was one module (now ``sim.replay.schema``) before sim/ had rooms: its names stay
# importable from here (``from sim.report import summary_row``), loaded on first use so that
# importing one module of the room imports no other.
from sim import _reexporting_getattr

__getattr__ = _reexporting_getattr(__name__, __path__, "sim.replay.schema")
