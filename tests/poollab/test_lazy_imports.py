"""``poollab --help`` and ``import traces`` load no command, reader or heavy library until used."""

import subprocess
import sys

import click

from poollab.cli import COMMANDS, cli

HEAVY = ("pandas", "numpy", "pyarrow", "simpy", "sim", "matplotlib")


def _modules_after(code: str) -> set[str]:
    out = subprocess.run(
        [sys.executable, "-c", f"{code}\nimport sys; print(' '.join(sys.modules))"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return set(out.split())


def test_the_cli_and_its_help_import_no_heavy_library():
    loaded = _modules_after(
        "from poollab.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass"
    )
    assert not loaded & set(HEAVY)
    assert not any(m.startswith("poollab.commands.") for m in loaded)


def test_traces_imports_its_readers_on_first_use():
    assert not _modules_after("import traces") & {"pandas", "pyarrow", "traces.detect"}
    assert {"pandas", "traces.detect"} <= _modules_after("import traces; traces.read_alloc_trace")


def test_every_public_traces_name_resolves():
    import traces

    assert all(getattr(traces, name) is not None for name in traces.__all__)


def test_each_listed_summary_is_the_first_paragraph_of_the_commands_help():
    ctx = click.Context(cli)
    for name, (_, summary) in COMMANDS.items():
        cmd = cli.get_command(ctx, name)
        assert cmd is not None and cmd.name == name
        assert " ".join(cmd.help.split("\n\n")[0].split()) == summary, name


def test_replay_imports_no_entry_point_machinery_before_its_read_starts():
    # what ``poollab replay`` imports before it can start its read ahead (``traces.read_ahead``)
    # is on its critical path: the entry points (importlib.metadata) and the write path's
    # secrets and ctypes wait until they are used
    before = _modules_after("pass")
    loaded = _modules_after("import poollab.cli, poollab.commands.replay") - before
    assert "poollab.commands.replay" in loaded
    assert not loaded & {"importlib.metadata", "secrets", "ctypes", *HEAVY[:4]}


def test_policy_entry_points_are_still_found_through_importlib_metadata():
    from policies import registry

    assert registry.entry_points(group="poollab.no-such-group") is not None
    assert "importlib.metadata" in _modules_after(
        "from policies import registry; registry.available()"
    )
