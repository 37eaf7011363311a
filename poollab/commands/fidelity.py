"""``poollab fidelity``: replay a PyTorch snapshot through an emulation and compare with the
recording."""

from __future__ import annotations

from pathlib import Path

import click

from poollab.options import (
    capacity_option,
    out_option,
    policy_option,
    progress_option,
    trace_device_option,
)
from poollab.errors import UsageError
from policies.torch_caching import spec_from_settings
from sim.replay.fidelity import ADDRESS_MODES, read_recording, replay_recording


#: What ``--out`` holds after a run (a folder written before poollab listed its files: these are
#: replaced).
FIDELITY_FILES = ("fidelity.csv", "segment_events.csv")


def register(cli: click.Group) -> None:
    cli.add_command(fidelity_command)


@click.command("fidelity")
@click.argument("snapshot", type=click.Path(dir_okay=False, path_type=Path))
@policy_option(
    "Policy spec, repeatable. Default: torch-caching with the snapshot's allocator_settings."
)
@click.option(
    "--addresses",
    type=click.Choice([*ADDRESS_MODES, "both"]),
    default="recorded",
    show_default=True,
    help="Segment addresses: the recorded cudaMalloc ones "
    "(PyTorch breaks best-fit ties by address), fresh virtual ones, or both runs.",
)
@capacity_option("Memory limit of the replayed pool (PyTorch's memory fraction). Default: none.")
@trace_device_option()
@out_option(
    None, "Also write fidelity.csv (the tables) and segment_events.csv (both sides, tidy) here."
)
@progress_option()
def fidelity_command(
    snapshot: Path, specs, addresses: str, capacity, device_index, out_dir, progress: bool
) -> None:
    """Does the emulation decide what the real allocator decided on SNAPSHOT?

    Starts from the segments and allocations that existed when recording began, replays the
    recorded requests, and compares segment allocations (count, bytes, order) and peak reserved
    bytes with the allocator's own segment events in the snapshot.
    """
    rec = read_recording(snapshot, device=device_index)
    if not rec.ops:
        which = f"device {device_index} has" if device_index is not None else "the snapshot has"
        raise UsageError(
            f"{snapshot}: {which} no allocation trace "
            "(record with torch.cuda.memory._record_memory_history() before taking it)"
        )
    spec_list = list(specs) or [spec_from_settings(rec.settings)]
    modes = list(ADDRESS_MODES) if addresses == "both" else [addresses]
    tables, events = [], []
    click.echo(
        f"{rec.name}: {rec.num_allocs:,} allocations, {len(rec.segment_events):,} segment events, "
        f"{len(rec.seed_segments)} segments "
        f"({rec.initial_reserved_bytes / 2**20:,.0f} MiB) before recording"
    )
    for spec in spec_list:
        for mode in modes:
            result = replay_recording(
                rec,
                spec,
                addresses=mode,
                capacity_bytes=capacity,
                progress=f"{rec.name} · {spec} · {mode}" if progress else None,
            )
            click.echo("")
            click.echo(result.format())
            tables.append(result.table.assign(policy=result.spec, addresses=mode))
            events.append(result.segment_events.assign(policy=result.spec, addresses=mode))
    if out_dir is not None:
        import pandas as pd

        from traces.atomic import naming_errors, replacing_folder

        with replacing_folder(
            out_dir, legacy_outputs=lambda entry: entry.name in FIDELITY_FILES
        ) as tmp:
            with naming_errors(out_dir / "fidelity.csv"):
                pd.concat(tables, ignore_index=True).to_csv(tmp / "fidelity.csv", index=False)
            with naming_errors(out_dir / "segment_events.csv"):
                pd.concat(events, ignore_index=True).to_csv(tmp / "segment_events.csv", index=False)
        click.echo(f"\nwrote {out_dir}/fidelity.csv, {out_dir}/segment_events.csv")
