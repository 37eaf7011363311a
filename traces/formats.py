"""The trace-format registry: ``{format: (sniff, read)}`` for each kind of trace, the one place a
format is added.

Two registries: ``ALLOC`` (allocation traces, for replay) and ``REQUEST`` (request traces, for
the serving simulator). Each maps a format name to a ``TraceFormat``: ``sniff(src)`` says from
the content whether a ``traces.source.TraceSource`` is in this format (the name may lie), and
``read(src, **options)`` reads it. Every reader entry point (``traces.read_alloc_trace``,
``traces.read_request_trace``, their ``detect_*`` functions), the sweep file and the command
line (``poollab replay --format``, the "this is a request trace" hint, ``poollab traces info``)
go through here, so a format registered once is read and detected everywhere::

    from traces.formats import ALLOC
    ALLOC.register("nvtx", sniff=lambda src: src.head(4) == b"NVTX", read=read_nvtx,
                   describe="an NVTX memory log")

The built-in formats are registered by the modules that read them (``traces.detect`` for
allocation traces, ``traces.request_readers`` for request traces), imported on the first
look-up, so that importing this module costs no pandas. Sniffers are asked in registration
order, built-ins first: a format whose content a built-in also claims is read with
``format=`` given.

Both kinds have a Parquet form with the same magic: ``TraceFormat.confirm`` (the columns) says
whether such a file is of this kind, asked only when telling the kinds apart (``trace_kind``).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from traces.errors import TraceFormatError
from traces.source import TraceSource, open_source

__all__ = ["TraceFormat", "FormatRegistry", "ALLOC", "REQUEST", "trace_kind", "HEAD_BYTES"]

#: Bytes a sniffer may look at (``src.head(HEAD_BYTES)``): a header line, a magic, a pickle opcode.
HEAD_BYTES = 1 << 16


@dataclass(frozen=True)
class TraceFormat:
    """One readable format.

    Attributes:
        name: the ``--format`` value and the trace's ``format``.
        sniff: ``sniff(src) -> bool``: the content is in this format (looks at ``src.head``).
        read: ``read(src, **options)``: the trace; options it does not use are ignored
            (allocation readers get ``device`` and ``lenient``, request readers ``name``).
        describe: what identifies it, in words, for the message when no format matches.
        confirm: for a container both kinds share (Parquet): ``confirm(src) -> bool``, the
            content is of this registry's kind (None: ``sniff`` says so already).
    """

    name: str
    sniff: Callable[[TraceSource], bool]
    read: Callable[..., Any]
    describe: str
    confirm: Callable[[TraceSource], bool] | None = None


class FormatRegistry:
    """The formats of one kind of trace, in registration order (built-ins first)."""

    def __init__(
        self,
        kind: str,
        what: str,
        builtins: str,
        *,
        empty_hint: str,
        unknown: Callable[[str, list[str]], str],
    ):
        self.kind = kind  # "alloc" or "request"
        self.what = what  # "allocation-trace", "request-trace": for messages
        self._builtins = builtins
        self._empty_hint = empty_hint
        self._unknown = unknown
        self._formats: dict[str, TraceFormat] = {}
        self._loaded = False

    def register(
        self,
        name: str,
        *,
        sniff: Callable[[TraceSource], bool],
        read: Callable[..., Any],
        describe: str,
        confirm: Callable[[TraceSource], bool] | None = None,
        replace: bool = False,
    ) -> TraceFormat:
        """Add a format; ValueError if ``name`` is taken (``replace=True`` replaces it in place)."""
        if not isinstance(name, str) or not name.strip():
            raise ValueError(f"a {self.what} format needs a name, not {name!r}")
        table = self._table()  # the built-ins first, whoever registers first
        if name in table and not replace:
            raise ValueError(
                f"{self.what} format {name!r} is registered already (replace=True replaces it)"
            )
        fmt = self._formats[name] = TraceFormat(name, sniff, read, describe, confirm)
        return fmt

    def unregister(self, name: str) -> None:
        self._formats.pop(name, None)

    def names(self) -> tuple[str, ...]:
        """Every format's name, in the order sniffers are asked."""
        return tuple(self._table())

    def get(self, name: str, path: object = "") -> TraceFormat:
        """The format called ``name``; a TraceFormatError naming ``path`` and the known ones if
        none."""
        table = self._table()
        if name not in table:
            raise TraceFormatError(
                path, None, f"unknown {self.what} format {name!r}; known: {', '.join(table)}"
            )
        return table[name]

    def detect(self, path: str | Path | TraceSource) -> str:
        """The format of ``path`` from its content (read once, ``traces.source``).

        Raises:
            TraceFormatError: empty, damaged, over the size limit, or matching no format.
        """
        src = open_source(path)
        head = src.head(HEAD_BYTES)
        if not head.strip():
            if src.damage is not None and not head:  # a damaged gzip stream that yields nothing
                raise TraceFormatError(src.path, None, src.damage)
            raise TraceFormatError(
                src.path,
                None,
                ("gzip stream holds nothing" if src.gzipped and not head else "empty file")
                + self._empty_hint,
            )
        for fmt in self._table().values():
            if fmt.sniff(src):
                return fmt.name
        text = head.decode("utf-8", errors="replace").lstrip("\ufeff")
        first = next((line for line in text.splitlines() if line.strip()), "")
        raise TraceFormatError(
            src.path, 1, self._unknown(first, [f.describe for f in self._table().values()])
        )

    def read(
        self, path: str | Path | TraceSource, *, format: str | None = None, **options: Any
    ) -> Any:
        """Read ``path`` in ``format`` (None: detected from the content), read once whatever it
        is."""
        fmt = None if format is None else self.get(format, path)
        src = open_source(path)
        fmt = fmt or self._table()[self.detect(src)]
        return fmt.read(src, **options)

    def recognises(self, path: str | Path | TraceSource) -> str | None:
        """The format of ``path`` if it is a trace of this kind (``confirm`` asked), else None."""
        try:
            src = open_source(path)
            fmt = self._table()[self.detect(src)]
            return fmt.name if fmt.confirm is None or fmt.confirm(src) else None
        except Exception:  # noqa: BLE001 (a hint only: any failure to tell means "not this kind")
            return None

    def _table(self) -> dict[str, TraceFormat]:
        if not self._loaded:
            self._loaded = True
            importlib.import_module(
                self._builtins
            )  # registers the built-ins (a no-op while it is importing)
        return self._formats


def _or(items: list[str]) -> str:
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} or {items[-1]}"


ALLOC = FormatRegistry(
    "alloc",
    "allocation-trace",
    "traces.detect",
    empty_hint="",
    unknown=lambda first, describes: (
        f"cannot tell the format from the first line {first[:80]!r}: expected {_or(describes)}"
    ),
)
REQUEST = FormatRegistry(
    "request",
    "request-trace",
    "traces.request_readers",
    empty_hint=": no header line or JSON object",
    unknown=lambda first, describes: (
        f"unrecognised request-trace header {first.strip()[:120]!r}; "
        f"expected {'; '.join(describes[:-1])}; or {describes[-1]}"
    ),
)
REGISTRIES = {"alloc": ALLOC, "request": REQUEST}


def trace_kind(path: str | Path | TraceSource) -> tuple[str, str]:
    """``("alloc" | "request", format)`` of a trace of either kind, told from its content.

    Raises:
        TraceFormatError: it is neither kind (naming every format of both).
    """
    src = open_source(path)
    for registry in (ALLOC, REQUEST):
        fmt = registry.recognises(src)
        if fmt is not None:
            return registry.kind, fmt
    raise TraceFormatError(
        src.path,
        None,
        f"neither an allocation trace ({', '.join(ALLOC.names())}) nor a request trace "
        f"({', '.join(REQUEST.names())})",
    )
