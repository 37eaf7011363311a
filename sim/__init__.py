"""Replay and simulation on top of ``policies`` and ``traces``, in rooms (ARCHITECTURE.md):

- ``sim.replay``: the one replay loop, costs, the pool monitor, the report schema every backend
  writes (``sim.replay.schema``, ``sim.replay.serving_metrics``), the model/GPU presets, trace
  replay, bounds, fidelity; ``realgpu`` imports only this room;
- ``sim.serving``: the simulated inference server (simpy), its settings, step time;
- ``sim.planner``: how much KV cache an engine can allocate, from its start-up snapshot;
- ``sim.sweep``: grids of runs, resumable, and their Pareto fronts;
- ``sim.report``: the HTML report and the figures.
"""

# --- old module paths (before sim/ had rooms): ``import sim.engine``, ``from sim.simulate import
# simulate``, ``sim.plots`` keep importing, as the same module objects as their new paths, so a
# user's notebook written against the flat layout runs unchanged. ``sim.replay`` and ``sim.report``
# are rooms now; they re-export the names of the modules that had their names.
import importlib as _importlib
import importlib.abc as _abc
import importlib.util as _util
import sys as _sys

#: old module (under ``sim.``) -> its new home; a package row covers its submodules
MOVED = {
    "engine": "replay.engine",
    "costs": "replay.costs",
    "metrics": "replay.metrics",
    "bounds": "replay.bounds",
    "compaction_log": "replay.compaction_log",
    "progress": "replay.progress",
    "fidelity": "replay.fidelity",
    "interactive.layout": "replay.layout",
    "config": "serving.config",
    "server": "serving.server",
    "scheduler": "serving.scheduler",
    "kv": "serving.kv",
    "kv_groups": "serving.kv_groups",
    "pools": "serving.pools",
    "steptime": "serving.steptime",
    "step_fit": "serving.step_fit",
    "engine_runs": "serving.engine_runs",
    "models": "replay.models",
    "engines": "serving.engines",
    "hardware": "replay.hardware",
    "simulate": "serving.simulate",
    "serving_metrics": "replay.serving_metrics",
    "tenants": "serving.tenants",
    "plan": "planner.plan",
    "startup_kv": "planner.startup_kv",
    "html_report": "report.html",
    "bounded_tables": "report.bounded_tables",
    "plots": "report.plots",
    "interactive": "report.interactive",
    # shared with ``realgpu`` (the model/GPU presets, the request table and serving columns): in the
    # replay room since session 13, from the serving room's old paths
    "serving.models": "replay.models",
    "serving.hardware": "replay.hardware",
    "serving.serving_metrics": "replay.serving_metrics",
}


def _new_home(fullname: str) -> str | None:
    if not fullname.startswith("sim."):
        return None
    parts = fullname[4:].split(".")
    for n in range(len(parts), 0, -1):
        head = ".".join(parts[:n])
        if head in MOVED:
            return ".".join(["sim", MOVED[head], *parts[n:]])
    return None


class _Alias(_abc.Loader):
    def __init__(self, target: str):
        self.target = target

    def create_module(self, spec):  # noqa: D102 (the default module; exec_module swaps it)
        return None

    def exec_module(self, module) -> None:
        # the import system returns what sys.modules holds under the old name after this
        _sys.modules[module.__name__] = _importlib.import_module(self.target)


class _MovedModules(_abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        home = _new_home(fullname)
        return None if home is None else _util.spec_from_loader(fullname, _Alias(home))


if not any(isinstance(f, _MovedModules) for f in _sys.meta_path):
    _sys.meta_path.insert(0, _MovedModules())


def _reexporting_getattr(package: str, path: list[str], module: str):
    """A ``__getattr__`` for a room named like a module it replaced: ``module``'s names, imported
    on first use; the room's own submodules are left to the import system."""
    import pkgutil

    submodules = frozenset(m.name for m in pkgutil.iter_modules(path))

    def __getattr__(name: str):
        if name.startswith("__") or name in submodules:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        try:
            return getattr(_importlib.import_module(module), name)
        except AttributeError:
            raise AttributeError(f"module {package!r} has no attribute {name!r}") from None

    return __getattr__


def __getattr__(name: str):
    if name in MOVED and "." not in name:
        return _importlib.import_module(f"sim.{name}")
    raise AttributeError(f"module 'sim' has no attribute {name!r}")
