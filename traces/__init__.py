"""Allocation and request traces: readers, writers, generators. Knows nothing of policies."""

from traces.errors import TraceFormatError
from traces.events import EVENT_COLUMNS, AllocTrace, make_events, validate_events

__all__ = ["TraceFormatError", "EVENT_COLUMNS", "AllocTrace", "make_events", "validate_events"]
