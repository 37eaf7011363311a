"""``poollab policies``: list every registered policy with its knobs and defaults."""

from __future__ import annotations

import click

import policies


def register(cli: click.Group) -> None:
    cli.add_command(policies_command)


@click.command("policies")
def policies_command() -> None:
    """List registered policies (built-in and third-party) and their parameters."""
    for name in policies.available():
        cls = policies.get(name)
        doc = (cls.__doc__ or "").strip().splitlines()[0] if cls.__doc__ else ""
        click.echo(f"{name:<16} {doc}")
        params = {k: v for k, v in cls.param_defaults().items() if k != "capacity_bytes"}
        if params:
            click.echo(" " * 17 + ", ".join(f"{k}={v}" for k, v in params.items()))
