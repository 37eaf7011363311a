"""Allocation and request traces: readers, writers, generators. Knows nothing of policies.

Allocation traces (one event per ``alloc``/``free``) feed replay; request traces (one row per
LLM request) feed the serving simulator. Readers detect the format from the file's content and
raise ``TraceFormatError`` naming file, line and problem. Formats are registered in
``traces.formats`` (``ALLOC``, ``REQUEST``: ``{format: (sniff, read)}``), the one place a new one
is added; ``traces.spec_grammar`` and ``traces.knobs`` hold the ``key=value`` grammar and the
knob validator that ``policies`` shares (standard library only).

The names below are imported on first use (PEP 562 ``__getattr__``): the readers pull in
pandas and pyarrow, which a command that only needs ``TraceFormatError`` (or ``--help``) should
not pay for. The request generator is ``traces.synth_requests.synth_requests``: a package-level
name equal to a submodule's would be replaced by that module once anything imports it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from traces.errors import TraceFormatError

#: Public name -> the module that defines it (a dict: one lookup per first use).
_LAZY_NAMES = {
    **dict.fromkeys(["bundled_names", "bundled_path"], "traces.bundled"),
    **dict.fromkeys(["ALLOC_FORMATS", "detect_alloc_format", "read_alloc_trace"], "traces.detect"),
    **dict.fromkeys(
        ["EVENT_COLUMNS", "AllocTrace", "make_events", "validate_events"], "traces.events"
    ),
    "write_alloc_trace": "traces.alloc_table",
    "describe_alloc_trace": "traces.info",
    **dict.fromkeys(
        ["REQUEST_FORMATS", "detect_request_format", "read_request_trace", "write_request_trace"],
        "traces.request_readers",
    ),
    **dict.fromkeys(
        ["REQUEST_COLUMNS", "RequestTrace", "make_requests", "validate_requests"], "traces.requests"
    ),
    "generate_alloc_trace": "traces.synth_alloc",
    **dict.fromkeys(
        [
            "Empirical",
            "Fixed",
            "Lognormal",
            "PrefixSharing",
            "Zipf",
            "parse_length_dist",
            "parse_prefix_sharing",
        ],
        "traces.synth_requests",
    ),
}

__all__ = [
    "TraceFormatError",
    "EVENT_COLUMNS",
    "AllocTrace",
    "make_events",
    "validate_events",
    "ALLOC_FORMATS",
    "detect_alloc_format",
    "read_alloc_trace",
    "write_alloc_trace",
    "describe_alloc_trace",
    "generate_alloc_trace",
    "bundled_path",
    "bundled_names",
    "REQUEST_COLUMNS",
    "RequestTrace",
    "make_requests",
    "validate_requests",
    "REQUEST_FORMATS",
    "read_request_trace",
    "write_request_trace",
    "detect_request_format",
    "Lognormal",
    "Zipf",
    "Empirical",
    "Fixed",
    "PrefixSharing",
    "parse_length_dist",
    "parse_prefix_sharing",
]


def __getattr__(name: str) -> Any:
    module = _LAZY_NAMES.get(name)
    if module is None:
        raise AttributeError(f"module 'traces' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:  # static checkers and IDEs see the eager imports
    from traces.alloc_table import write_alloc_trace
    from traces.bundled import bundled_names, bundled_path
    from traces.detect import ALLOC_FORMATS, detect_alloc_format, read_alloc_trace
    from traces.events import EVENT_COLUMNS, AllocTrace, make_events, validate_events
    from traces.info import describe_alloc_trace
    from traces.request_readers import (
        REQUEST_FORMATS,
        detect_request_format,
        read_request_trace,
        write_request_trace,
    )
    from traces.requests import REQUEST_COLUMNS, RequestTrace, make_requests, validate_requests
    from traces.synth_alloc import generate_alloc_trace
    from traces.synth_requests import (
        Empirical,
        Fixed,
        Lognormal,
        PrefixSharing,
        Zipf,
        parse_length_dist,
        parse_prefix_sharing,
    )
