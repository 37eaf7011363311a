"""The trace-format registry: a format registered once is sniffed and read by every entry point."""

import io

import pytest

import traces
from poollab.cli import main
from traces.errors import TraceFormatError
from traces.events import AllocTrace, make_events
from traces.formats import ALLOC, REQUEST, trace_kind
from traces.requests import RequestTrace, make_requests

TOY_TEXT = "#toy-alloc\n+ 1 4096\n+ 2 70000\n- 1\n- 2\n"


def _read_toy(src, **options):
    """A toy allocation log: ``+ id nbytes`` allocates, ``- id`` frees, one event a microsecond."""
    rows, sizes = [], {}
    lines = io.TextIOWrapper(src.stream(), encoding="utf-8").read().splitlines()[1:]
    for lineno, line in enumerate(lines, 2):
        op, alloc_id, *rest = line.split()
        if op == "+":
            sizes[alloc_id] = int(rest[0])
        elif op != "-" or alloc_id not in sizes:
            raise TraceFormatError(src.path, lineno, f"cannot read {line!r}")
        rows.append((len(rows), "alloc" if op == "+" else "free", int(alloc_id), sizes[alloc_id]))
    time_us, ops, ids, nbytes = zip(*rows)
    return AllocTrace(
        make_events(time_us, ops, ids, nbytes),
        name=src.path.stem,
        source=str(src.path),
        format="toy-alloc",
    )


@pytest.fixture
def toy_format():
    ALLOC.register(
        "toy-alloc",
        sniff=lambda src: src.head(10) == b"#toy-alloc",
        read=_read_toy,
        describe="a toy log (#toy-alloc)",
    )
    yield
    ALLOC.unregister("toy-alloc")


def test_a_registered_format_is_sniffed_and_read(tmp_path, toy_format):
    path = tmp_path / "run.log"
    path.write_text(TOY_TEXT)
    assert traces.detect_alloc_format(path) == "toy-alloc"
    trace = traces.read_alloc_trace(path)
    assert trace.format == "toy-alloc" and len(trace) == 4
    assert trace_kind(path) == ("alloc", "toy-alloc")
    assert (
        "toy-alloc" in ALLOC.names() and ALLOC.names()[:4] == traces.ALLOC_FORMATS
    )  # built-ins first


def test_replay_reads_a_registered_format(tmp_path, toy_format, capsys):
    path = tmp_path / "run.log"
    path.write_text(TOY_TEXT)
    main(["replay", str(path), "-p", "first-fit", "--out", str(tmp_path / "out"), "--no-progress"])
    out, _ = capsys.readouterr()
    assert "run: 4 events (toy-alloc)" in out
    assert (tmp_path / "out" / "summary.csv").exists()


def test_the_format_option_takes_a_registered_name(tmp_path, toy_format):
    path = tmp_path / "run.txt"
    path.write_text(TOY_TEXT)
    assert traces.read_alloc_trace(path, format="toy-alloc").format == "toy-alloc"


def test_without_the_registration_the_message_lists_what_is_known(tmp_path):
    path = tmp_path / "run.log"
    path.write_text(TOY_TEXT)
    with pytest.raises(TraceFormatError, match="cannot tell the format .* or Parquet") as err:
        traces.read_alloc_trace(path)
    assert err.value.line == 1
    with pytest.raises(
        TraceFormatError,
        match="unknown allocation-trace format 'toy-alloc'; known: pytorch-snapshot",
    ):
        traces.read_alloc_trace(path, format="toy-alloc")


def test_the_unknown_message_names_a_registered_format(tmp_path, toy_format):
    path = tmp_path / "other.log"
    path.write_text("hello\n")
    with pytest.raises(TraceFormatError, match=r"or a toy log \(#toy-alloc\)"):
        traces.read_alloc_trace(path)


def test_a_name_is_registered_once(toy_format):
    with pytest.raises(ValueError, match="'toy-alloc' is registered already"):
        ALLOC.register("toy-alloc", sniff=lambda src: False, read=_read_toy, describe="again")


def test_a_request_format_is_read_by_read_request_trace(tmp_path):
    def read(src, name=None, **_):
        t, p, o = zip(
            *(map(float, ln.split(";")) for ln in src.head(1 << 16).decode().splitlines()[1:])
        )
        return RequestTrace(
            make_requests(t, [int(x) for x in p], [int(x) for x in o]), name=name or "x"
        )

    REQUEST.register(
        "semicolons", sniff=lambda src: src.head(5) == b"t;p;o", read=read, describe="t;p;o lines"
    )
    try:
        path = tmp_path / "reqs.txt"
        path.write_text("t;p;o\n0;100;5\n1.5;200;7\n")
        assert traces.detect_request_format(path) == "semicolons"
        trace = traces.read_request_trace(path)
        assert trace.name == "reqs" and trace.requests["prompt_tokens"].tolist() == [100, 200]
        assert trace_kind(path) == ("request", "semicolons")
    finally:
        REQUEST.unregister("semicolons")


def test_a_parquet_file_is_told_apart_by_its_columns(tmp_path):
    path = tmp_path / "reqs.parquet"
    traces.write_request_trace(
        RequestTrace(make_requests([0.0, 1.0], [10, 20], [1, 2]), name="r"), path
    )
    assert ALLOC.recognises(path) is None  # the Parquet magic, not the event columns
    assert trace_kind(path) == ("request", "parquet")


def test_neither_kind_names_both_kinds_formats(tmp_path):
    path = tmp_path / "x.txt"
    path.write_text("hello\n")
    with pytest.raises(
        TraceFormatError,
        match=r"neither an allocation trace \(pytorch-snapshot.*\) nor a request "
        r"trace \(azure.*\)",
    ):
        trace_kind(path)
