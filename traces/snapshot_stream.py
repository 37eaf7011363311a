"""Unpickle a PyTorch memory snapshot with one device's trace entries taken as they are read.

A snapshot's ``device_traces[d]`` holds 10^5-10^6 entry dicts (about 450 bytes each once
unpickled: 706 MB for 1.55M entries), while the reader needs only a few numbers of each. So
``load_streaming`` has C's unpickler build the snapshot as usual except for that one list: the
pickle's ``EMPTY_LIST`` opcode that starts it is swapped (in a view over the bytes, not a
copy) for a call that makes a ``StreamedEntries`` instead. The unpickler hands a list its items
in batches (``APPENDS``, 1,000 at a time, through the list's ``extend`` when it is no exact
``list``), so ``StreamedEntries.extend`` passes each batch to the caller's ``consume`` and then
empties the batch's dicts: at most one batch of whole entries lives at once. (The unpickler's
memo still holds each entry dict, as ``pickle`` memoizes every container, but emptied: 64 bytes
an entry, not 450, until ``load`` returns.)

Finding that opcode takes a walk over the opcodes before it (``pickletools.genops``, with a
model of the unpickler's stack good enough to tell the top-level dict's ``device_traces``
value and the lists in it), which covers ``segments`` and any earlier empty device lists only.
Whenever the file is not laid out so (an older protocol, a device list not found, a non-empty
device list before the one wanted), ``load_streaming`` returns None and the caller unpickles the
whole snapshot as before; ``StreamedEntries.fallback`` asks the same when an entry turns out
to be shared with another (a batch met an emptied dict).

Knows nothing of what an entry means: the caller's ``consume(batch, start)`` parses it.
"""

from __future__ import annotations

import pickle
import pickletools
from collections import deque
from typing import Any, Callable, Iterator

__all__ = [
    "StreamedEntries",
    "find_device_list",
    "load_streaming",
    "release_freed_memory",
    "STREAM_GLOBAL",
]

#: The global the swapped-in opcodes name; only the snapshot unpickler of ``load_streaming``
#: resolves it.
STREAM_GLOBAL = ("traces.snapshot_stream", "StreamedEntries")
#: Most opcodes walked while looking for the device list (the segments table of a large server
#: is ~10^5 opcodes); past it the whole-file path is cheaper than walking on in Python.
MAX_WALK_OPCODES = 500_000
#: Deepest stack the walk follows: a snapshot nests a few levels (a batch of 1,000 items on top).
MAX_WALK_DEPTH = 5_000
_FRAME = pickletools.code2op["\x95"] if "\x95" in pickletools.code2op else None
_MEMO_PUTS = {"PUT", "BINPUT", "LONG_BINPUT", "MEMOIZE"}
_MEMO_GETS = {"GET", "BINGET", "LONG_BINGET"}
_STRINGS = {"SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE"}
_CONTAINER_KEEPING = {"APPEND", "APPENDS", "SETITEM", "SETITEMS", "ADDITEMS", "BUILD"}


def release_freed_memory() -> None:
    """Hand the free pages inside the C heap back to the system (glibc's ``malloc_trim``; elsewhere
    nothing).

    A read frees its emptied entry dicts, the unpickler's memo and its column copies all at once,
    in the middle of the heap: glibc keeps such pages (140 MB after a 1.5M-entry snapshot), and
    every worker forked later counts them in its resident set. The call takes ~50 ms.
    """
    global _LIBC
    if _LIBC is None:
        try:
            import ctypes
            import ctypes.util

            _LIBC = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            _LIBC.malloc_trim  # noqa: B018 - not glibc (musl, macOS): no such call
        except (OSError, AttributeError):
            _LIBC = False
    if _LIBC:
        _LIBC.malloc_trim(0)


_LIBC = None


_PLAIN_DICT = {dict}


class StreamedEntries:
    """One device's trace entries, parsed batch by batch as the unpickler appends them.

    ``consume(batch, start)`` gets each batch and the index of its first entry; what it keeps is
    its own. ``len`` counts the entries; ``first_time_us`` is the first entry's ``time_us``
    (None when it has none or is no dict), as ``parse_snapshot`` reads the time origin.
    ``fallback`` is set when the streamed read cannot stand for the whole-file one (a shared
    entry dict): the caller then reads the file whole.
    """

    __slots__ = ("device", "consume", "num_entries", "first_time_us", "fallback")

    def __init__(self, device: int, consume: Callable[[list, int], bool]):
        self.device = device
        self.consume = consume
        self.num_entries = 0
        self.first_time_us: Any = None
        self.fallback = False

    def __len__(self) -> int:
        return self.num_entries

    def extend(self, batch: list) -> None:
        if self.fallback:
            return
        if not self.num_entries and batch:
            first = batch[0]
            self.first_time_us = first.get("time_us") if isinstance(first, dict) else None
        # ``all`` first: one C pass over the batch's truth (0.02 s for 1.5M entries, the generator
        # 0.24 s); only a batch holding a falsy item needs the look for an empty dict
        if not all(batch) and any(isinstance(e, dict) and not e for e in batch):
            # an empty dict is a malformed entry, or one emptied earlier and met again (a shared
            # object): only the whole-file read tells them apart
            self.fallback = True
            return
        self.consume(batch, self.num_entries)
        self.num_entries += len(batch)
        # the memo keeps each dict: keep it empty (the numbers are parsed already); a batch of plain
        # dicts (every real one) is emptied by one C loop, anything else dict by dict as before
        if set(map(type, batch)) == _PLAIN_DICT:
            deque(map(dict.clear, batch), maxlen=0)
        else:
            for e in batch:
                if isinstance(e, dict):
                    e.clear()

    def append(self, entry: Any) -> None:
        self.extend([entry])


#: Size of the pieces ``load_streaming`` copies a snapshot into when it may let the content go.
CHUNK_BYTES = 8 << 20


class _Pieces:
    """A read-only file over a few byte ranges (the snapshot with its opcode swapped), copying
    none; each piece is let go once read past (the pieces ``load_streaming`` copied are then
    freed as the unpickler reads on). ``more``: an iterator of the pieces that follow, taken as
    the reads reach them (a decompression still under way: ``traces.source.ThreadedInflate``)."""

    def __init__(self, pieces: list, more: Iterator[bytes] | None = None):
        self.pieces = [memoryview(p) for p in pieces if len(p)]
        self.more = more
        self.k = 0
        self.offset = 0

    def _next_piece(self) -> None:
        self.pieces[self.k] = None
        self.k, self.offset = self.k + 1, 0

    def _fill(self) -> None:
        """Take the next of ``more`` when every piece in hand is read."""
        while self.k == len(self.pieces) and self.more is not None:
            piece = next(self.more, None)
            if piece is None:
                self.more = None
            elif len(piece):
                self.pieces.append(memoryview(piece))

    def read(self, n: int = -1) -> bytes:
        self._fill()
        out = []
        while self.k < len(self.pieces) and (n < 0 or n > 0):
            piece = self.pieces[self.k]
            take = len(piece) - self.offset if n < 0 else min(n, len(piece) - self.offset)
            out.append(piece[self.offset : self.offset + take])
            self.offset += take
            if n > 0:
                n -= take
            if self.offset == len(piece):
                self._next_piece()
                self._fill()
        return b"".join(out)

    def readinto(self, buf) -> int:
        data = self.read(len(buf))
        buf[: len(data)] = data
        return len(data)

    def readline(self) -> bytes:
        self._fill()
        out = []
        while self.k < len(self.pieces):
            piece = self.pieces[self.k]
            end = bytes(piece[self.offset :]).find(b"\n")
            if end >= 0:
                out.append(piece[self.offset : self.offset + end + 1])
                self.offset += end + 1
                if self.offset == len(piece):
                    self._next_piece()
                break
            out.append(piece[self.offset :])
            self._next_piece()
            self._fill()
        return b"".join(out)


class _Token:
    """A stack item of the walk: what the walk needs to know of an unpickled object."""

    __slots__ = ("kind", "count")

    def __init__(self, kind: str):
        self.kind = kind  # "dict", "list", "outer" (device_traces), "device", "mark", "other"
        self.count = 0  # items appended so far (lists)


_MARK = _Token("mark")


def find_device_list(data, device: int | None) -> tuple[int, int, tuple[int, int] | None] | None:
    """Where ``device_traces[device]`` (default: the first non-empty one) starts in a pickle.

    Returns ``(position of its EMPTY_LIST opcode, device index, frame)``, ``frame`` being
    ``(position of the FRAME opcode holding it, frame length)`` or None when unframed; None when
    the pickle is not laid out so (see the module docstring).
    """
    stack: list[Any] = []
    marks: list[
        int
    ] = []  # where each MARK on the stack is: the last one found at once, not by a scan
    memo: dict[int, Any] = {}
    frame: tuple[int, int] | None = None
    top: _Token | None = None
    outer: _Token | None = None
    devices: list[_Token] = []
    pending: tuple[int, int, _Token] | None = None  # a device list whose first item is not seen yet
    try:
        ops = pickletools.genops(data)
        for num_ops, (op, arg, pos) in enumerate(ops):
            if num_ops > MAX_WALK_OPCODES or len(stack) > MAX_WALK_DEPTH:
                return None
            name = op.name
            if pending is not None and name not in _MEMO_PUTS:
                at, dev, token = pending
                pending = None
                if name not in (
                    "EMPTY_LIST",
                    "APPEND",
                    "APPENDS",
                ):  # its first item, or the batch mark
                    if device is None and all(d.count == 0 for d in devices[:-1]):
                        return at, dev, _frame_at(frame, at)
                    if device is None:
                        return None  # an earlier device list had items after all: read it whole
            if name == "FRAME":
                frame = (pos, arg)
                continue
            if name in ("PROTO", "STOP"):
                if name == "STOP":
                    return None
                continue
            if name == "MARK":
                marks.append(len(stack))
                stack.append(_MARK)
            elif name in _MEMO_PUTS:
                memo[len(memo) if name == "MEMOIZE" else arg] = stack[-1]
            elif name in _MEMO_GETS:
                stack.append(memo[arg])
            elif name in _STRINGS:
                stack.append(arg)
            elif name == "EMPTY_DICT":
                token = _Token("dict")
                if top is None and not stack:
                    top = token
                stack.append(token)
            elif name == "EMPTY_LIST":
                token = _Token("list")
                if outer is None and top is not None and _is_value_of(stack, top, "device_traces"):
                    token = outer = _Token("outer")
                elif outer is not None and (
                    stack[-1] is outer or (marks and marks[-1] and stack[marks[-1] - 1] is outer)
                ):
                    token = _Token("device")
                    devices.append(token)
                    dev = outer.count + (0 if stack[-1] is outer else len(stack) - marks[-1] - 1)
                    if device is not None and dev == device:
                        return pos, dev, _frame_at(frame, pos)
                    if device is None:
                        pending = (pos, dev, token)
                stack.append(token)
            elif name in _CONTAINER_KEEPING:
                if op.stack_before and pickletools.markobject in op.stack_before:
                    m = marks.pop()
                    num = len(stack) - m - 1
                    del stack[m:]
                else:
                    num = len(op.stack_before) - 1
                    del stack[len(stack) - num :]
                if name in ("APPEND", "APPENDS"):
                    stack[-1].count += num
            elif name == "POP_MARK":
                del stack[marks.pop() :]
            elif name == "DUP":
                stack.append(stack[-1])
            else:  # any other opcode: pop what it takes (through a mark), push opaque results
                before = op.stack_before
                if pickletools.markobject in before:
                    k = before.index(pickletools.markobject)
                    m = marks.pop()
                    del stack[m:]
                    if k:
                        del stack[len(stack) - k :]
                elif before:
                    if len(before) > len(stack):
                        return None
                    del stack[len(stack) - len(before) :]
                while marks and marks[-1] >= len(stack):  # a pickle that pops a mark as an object
                    marks.pop()
                stack.extend(_Token("other") for _ in op.stack_after)
    except Exception:  # a pickle this walk cannot follow: the whole-file path reads (and judges) it
        return None
    return None


def _is_value_of(stack: list, top: _Token, key: str) -> bool:
    """Whether the next object pushed is the value of ``key`` in the top-level dict ``top``."""
    if len(stack) == 2:
        return stack[0] is top and stack[1] == key
    return (
        len(stack) >= 3
        and stack[0] is top
        and stack[1] is _MARK
        and (len(stack) - 2) % 2 == 1
        and stack[-1] == key
        and isinstance(stack[-1], str)
    )


def _frame_at(frame: tuple[int, int] | None, pos: int) -> tuple[int, int] | None:
    if frame is not None and frame[0] + 9 <= pos < frame[0] + 9 + frame[1]:
        return frame
    return None


def load_streaming(
    data,
    found: tuple[int, int, tuple[int, int] | None],
    unpickler: Callable[[Any], pickle.Unpickler],
    consume: Callable[[list, int], Any],
    release: Callable[[], None] | None = None,
    more: Iterator[bytes] | None = None,
) -> tuple[Any, StreamedEntries] | None:
    """Unpickle ``data`` with the device list ``found`` by ``find_device_list`` read into a
    ``StreamedEntries`` over ``consume``; None when the swapped-in call was never reached.

    ``unpickler(file)`` makes the unpickler; its ``find_class`` must resolve ``STREAM_GLOBAL`` to
    its ``stream_global`` attribute, which this sets. Unpickling errors propagate.

    ``release``, when given, lets the caller's ``data`` go: the bytes are first copied into pieces
    of ``CHUNK_BYTES``, then ``release()`` is called, and each piece is freed once the unpickler
    has read past it. So the content (104 MB for a 1.5M-entry snapshot) shrinks as the entries,
    the memo and the columns grow, instead of being held under all of them until the end.

    ``more``, when given, yields the bytes that follow ``data`` (``data`` is then the content's
    first piece only, which must hold the device list's start), read as the unpickler reaches
    them and each freed once read past.
    """
    pos, dev, frame = found
    entries = StreamedEntries(dev, consume)
    call = b"c" + "\n".join(STREAM_GLOBAL).encode() + b"\n)R"
    view = memoryview(data)
    if frame is None:
        pieces = [view[:pos], call, view[pos + 1 :]]
    else:  # the frame holding the opcode grows by the bytes swapped in
        at, length = frame
        pieces = [
            view[: at + 1],
            (length + len(call) - 1).to_bytes(8, "little"),
            view[at + 9 : pos],
            call,
            view[pos + 1 :],
        ]
    if release is not None:
        pieces = [
            bytes(p[i : i + CHUNK_BYTES]) for p in pieces for i in range(0, len(p), CHUNK_BYTES)
        ]
        view.release()
        del view, data
        release()
    made: list[StreamedEntries] = []

    def make() -> StreamedEntries:
        if made:
            raise pickle.UnpicklingError("the snapshot names the streamed trace twice")
        made.append(entries)
        return entries

    u = unpickler(_Pieces(pieces, more))
    del pieces  # the file holds them now, and lets each go once read
    u.stream_global = make
    snap = u.load()
    return (snap, entries) if made else None
