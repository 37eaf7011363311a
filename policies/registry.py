"""Finding policies by name: the built-in table merged with the ``poollab.policies`` entry points.

Modelled on xarray's backend plugins: built-ins are import strings loaded on first use, third
parties register a class under the entry-point group ``poollab.policies`` (or call
``register`` at run time), the merged table is cached, and a duplicate name warns and keeps the
first. Every policy found here is listed by ``available()``, built by ``create()`` and run by
the conformance suite, the command line, the simulator and the GPU pool alike.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import warnings
from typing import Any, Iterator

from policies.base import Policy
from policies.device import Device
from policies.device_kind import DeviceKind
from policies.errors import PolicyError
from policies.spec import parse_spec

__all__ = [
    "available",
    "get",
    "create",
    "register",
    "device_kind",
    "can_hold_kv",
    "ENTRY_POINT_GROUP",
]

ENTRY_POINT_GROUP = "poollab.policies"

#: name -> "module:Class"; imported on first use so listing names stays cheap.
BUILTIN_POLICIES: dict[str, str] = {
    "first-fit": "policies.first_fit:FirstFit",
    "best-fit": "policies.best_fit:BestFit",
    "size-class": "policies.size_class:SizeClass",
    "paged": "policies.paged:Paged",
    "elastic": "policies.elastic:Elastic",
    "torch-caching": "policies.torch_caching:TorchCaching",
    "cupy-pool": "policies.cupy_pool:CupyPool",
    "buddy": "policies.buddy:Buddy",
    "tlsf": "policies.tlsf:TLSF",
    "arena": "policies.arena:Arena",
    "worst-fit": "policies.worst_fit:WorstFit",
    "compacting": "policies.compacting:Compacting",
    "tag-limits": "policies.tag_limits:TagLimits",
    "vmm-stitch": "policies.vmm_stitch:VmmStitch",
    "page-pool": "policies.page_pool:PagePool",
    "expandable": "policies.expandable:Expandable",
}

_runtime: dict[str, type[Policy] | str] = {}


def entry_points(**selection: Any):
    """``importlib.metadata.entry_points``, imported at the first look-up: the module (email,
    zipfile, csv, ...) is 0.1 s of every command's start, and ``poollab replay`` starts reading
    its trace only once the command line is parsed, i.e. after ``policies`` is imported."""
    from importlib import metadata

    return metadata.entry_points(**selection)


@functools.lru_cache(maxsize=1)
def _entry_point_table() -> dict[str, Any]:
    table: dict[str, Any] = {}
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name in BUILTIN_POLICIES or ep.name in table:
            warnings.warn(
                f"policy {ep.name!r} from entry point {ep.value!r} is already registered; ignored",
                RuntimeWarning,
                stacklevel=3,
            )
            continue
        table[ep.name] = ep
    return table


def _table() -> dict[str, Any]:
    merged: dict[str, Any] = dict(BUILTIN_POLICIES)
    for name, ep in _entry_point_table().items():
        merged.setdefault(name, ep)
    merged.update(
        _runtime
    )  # run-time registrations win (register(..., replace=True) can shadow a built-in)
    return merged


def available(*, holds_kv: bool = False) -> list[str]:
    """Names of every registered policy: built-ins first, then third-party ones; with ``holds_kv``,
    only those that can hold a simulated server's KV cache (``can_hold_kv``: what ``simulate``
    runs when no policy is named)."""
    names = list(_table())
    return [n for n in names if can_hold_kv(n)] if holds_kv else names


def register(name: str, cls: type[Policy] | str, *, replace: bool = False) -> None:
    """Register a policy class (or a ``"module:Class"`` string) under ``name`` at run time."""
    if not replace and name in _table():
        raise PolicyError(f"policy {name!r} is already registered")
    _runtime[name] = cls


def unregister(name: str) -> None:
    _runtime.pop(name, None)


@functools.lru_cache(maxsize=None)
def _load(target: str) -> type[Policy]:
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)


def get(name: str) -> type[Policy]:
    """The policy class registered as ``name``."""
    table = _table()
    if name not in table:
        raise PolicyError(f"unknown policy {name!r}; available: {', '.join(table)}")
    target = table[name]
    if isinstance(target, str):
        cls = _load(target)
    elif inspect.isclass(target):
        cls = target
    else:  # an entry point
        cls = target.load()
    if not (inspect.isclass(cls) and issubclass(cls, Policy)):
        raise PolicyError(
            f"policy {name!r} resolves to {cls!r}, which is not a policies.Policy subclass"
        )
    return cls


def create(
    spec: str | type[Policy] | Policy,
    *,
    capacity_bytes: int | None = None,
    device: Device | None = None,
    **params: Any,
) -> Policy:
    """Build a policy from a name, a spec string, a class, or another policy's knobs.

    ``create("size-class:classes_per_doubling=4", capacity_bytes=80 << 30)``; keyword
    ``params`` override those in the spec. Unknown names and parameters raise PolicyError.

    Given a policy object, a fresh one of its class from its ``get_params()`` (its
    ``capacity_bytes`` included, unless given here) on ``device``: scikit-learn's ``clone``. A
    wrapper's base is a spec among its knobs, so the whole stack is rebuilt on ``device``. The one
    way a policy is put on a device someone else owns (``realgpu.GpuPool``): a device is never
    swapped under a built policy, whose state (a page pool's range, an expandable range) was
    laid out on the device it was built with.
    """
    if isinstance(spec, Policy):
        cls, spec_params = type(spec), spec.get_params()
        label = spec.spec
    elif inspect.isclass(spec):
        cls, spec_params = spec, {}
        label = getattr(spec, "name", spec.__name__)
    else:
        with _naming(spec):
            name, spec_params = parse_spec(spec)
            cls = get(name)
            return _build(cls, name, spec_params, params, capacity_bytes, device, in_spec=True)
    return _build(cls, label, spec_params, params, capacity_bytes, device, in_spec=False)


@contextlib.contextmanager
def _naming(spec: Any) -> Iterator[None]:
    """Every PolicyError raised inside names ``spec``, the string the user wrote, once: the one
    place a bad value, an unknown knob or policy, a malformed spec or a wrapper's bad base is
    tied to the ``-p`` option, sweep entry or API call it came from."""
    try:
        yield
    except PolicyError as exc:
        text = spec.strip() if isinstance(spec, str) else spec
        raise exc.naming(text) from None


def _build(
    cls: type[Policy],
    label: str,
    spec_params: dict[str, Any],
    params: dict[str, Any],
    capacity_bytes: int | None,
    device: Device | None,
    *,
    in_spec: bool,
) -> Policy:
    """``cls`` built from its spec's knobs overridden by ``params``. ``in_spec``: inside
    ``_naming``, whose prefix names the policy, so a message need not (``label`` is for a class or
    an object, which have no spec string)."""
    merged = {**spec_params, **params}
    known = cls._param_names()
    unknown = [k for k in merged if k not in known]
    if unknown:
        raise PolicyError(
            f"policy {label!r} has no parameter {unknown[0]!r}; parameters: {', '.join(known)}"
        )
    if "capacity_bytes" in merged and capacity_bytes is None:
        capacity_bytes = merged.pop("capacity_bytes")
    merged.pop("capacity_bytes", None)
    try:
        return cls(capacity_bytes=capacity_bytes, device=device, **merged)
    except PolicyError:
        raise
    except (TypeError, ValueError) as exc:
        raise PolicyError(str(exc) if in_spec else f"policy {label!r}: {exc}") from None


def device_kind(spec: str | type[Policy] | Policy) -> DeviceKind:
    """The device a policy built from ``spec`` (a spec string, a class, or a policy object, by its
    knobs) needs (``policies.device_kind.DeviceKind``: segments or mapped pages), as it declares
    (``Policy.device_kind_for``; a knob such as ``virtual=true`` or a wrapper's base decides it).
    A third-party class may declare a plain string; one that is no kind raises PolicyError naming
    the policy."""
    if isinstance(spec, Policy):
        cls, params, label = type(spec), spec.get_params(), spec.spec
    elif inspect.isclass(spec):
        cls, params, label = spec, {}, getattr(spec, "name", "") or spec.__name__
    else:
        with _naming(spec):
            label, params = parse_spec(spec)
            cls = get(label)
            return _kind(label, cls.device_kind_for(params))
    return _kind(label, cls.device_kind_for(params))


def _kind(label: str, declared: Any) -> DeviceKind:
    try:
        return DeviceKind.parse(declared, where=f"policy {label!r}: device_kind")
    except ValueError as exc:
        raise PolicyError(str(exc)) from None


def can_hold_kv(spec: str | type[Policy]) -> bool:
    """Whether a policy built from ``spec`` can hold a KV cache (``Policy.can_hold_kv``; a
    wrapper's base decides it), without building it."""
    if inspect.isclass(spec):
        return spec.can_hold_kv_for({})
    with _naming(spec):
        name, params = parse_spec(spec)
        return get(name).can_hold_kv_for(params)
