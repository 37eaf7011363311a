"""Allocation and request traces: readers, writers, generators. Knows nothing of policies.

Allocation traces (one event per ``alloc``/``free``) feed replay; request traces (one row per
LLM request) feed the serving simulator. Readers detect the format from the file's content and
raise ``TraceFormatError`` naming file, line and problem.
"""

from traces.bundled import bundled_names, bundled_path
from traces.detect import ALLOC_FORMATS, detect_alloc_format, read_alloc_trace
from traces.errors import TraceFormatError
from traces.events import EVENT_COLUMNS, AllocTrace, make_events, validate_events
from traces.alloc_table import write_alloc_trace
from traces.info import describe_alloc_trace
from traces.request_readers import REQUEST_FORMATS, detect_request_format, read_request_trace, write_request_trace
from traces.requests import REQUEST_COLUMNS, RequestTrace, make_requests, validate_requests
from traces.synth_alloc import generate_alloc_trace
from traces.synth_requests import (Empirical, Fixed, Lognormal, PrefixSharing, Zipf, parse_length_dist,
                                   parse_prefix_sharing, synth_requests)

__all__ = [
    "TraceFormatError", "EVENT_COLUMNS", "AllocTrace", "make_events", "validate_events",
    "ALLOC_FORMATS", "detect_alloc_format", "read_alloc_trace", "write_alloc_trace", "describe_alloc_trace",
    "generate_alloc_trace", "bundled_path", "bundled_names",
    "REQUEST_COLUMNS", "RequestTrace", "make_requests", "validate_requests", "REQUEST_FORMATS",
    "read_request_trace", "write_request_trace", "detect_request_format",
    "synth_requests", "Lognormal", "Zipf", "Empirical", "Fixed", "PrefixSharing", "parse_length_dist",
    "parse_prefix_sharing",
]
