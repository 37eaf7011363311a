"""Fixtures shared by the command-line tests."""

from __future__ import annotations

import pytest

from poollab.cli import main

#: twelve requests in the Azure LLM inference trace's CSV layout, one a second
AZURE_TRACE = "TIMESTAMP,ContextTokens,GeneratedTokens\n" + "".join(
    f"2023-11-16 18:17:{i:02d}.0000000,{100 + 37 * i},{5 + i}\n" for i in range(12)
)


@pytest.fixture
def cli(capsys):
    """Run ``poollab`` in-process: ``cli(argv) -> (exit status, stdout, stderr)``."""

    def run(argv: list[str]) -> tuple[int, str, str]:
        try:
            main(argv)
            code = 0
        except SystemExit as exc:
            code = exc.code or 0
        out, err = capsys.readouterr()
        return code, out, err

    return run


@pytest.fixture
def cli_ok(capsys):
    """Run ``poollab`` in-process and require exit status 0: ``cli_ok(argv) -> captured (out,
    err)``."""

    def run(argv: list[str]):
        try:
            main(argv)
        except SystemExit as exc:  # click exits 0 explicitly for some commands
            assert exc.code in (0, None), exc.code
        return capsys.readouterr()

    return run


@pytest.fixture
def trace(tmp_path):
    """A small request trace file (``AZURE_TRACE``) for the commands that read one."""
    p = tmp_path / "azure.csv"
    p.write_text(AZURE_TRACE)
    return p
