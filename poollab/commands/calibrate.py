"""``poollab calibrate``: make the simulator's step time describe a real engine.

``steps PROFILE...`` fits the step-time terms to an engine's step profile, or to several pooled
(``sim.serving.step_fit``);
``requests REQUESTS`` infers them from a served-request table alone (``sim.serving.engine_runs``).
Both write a calibration file that ``simulate``, ``colocate`` and ``sweep`` read with
``--calibration`` (``sim.serving.steptime.load_step_calibration``).
"""

from __future__ import annotations

import json
from pathlib import Path

import click

from poollab.errors import UsageError
from poollab.options import COUNT, Count, engine_option, gpu_option, model_option, out_file_option

__all__ = ["register"]


def register(cli: click.Group) -> None:
    cli.add_command(calibrate_group)


@click.group("calibrate")
def calibrate_group() -> None:
    """Fit the simulator's step time to a real engine (a step profile, or a request table alone)."""


def _specs(model: str, gpu: str):
    from sim.replay.hardware import load_gpu
    from sim.replay.models import load_model

    try:
        return load_model(model), load_gpu(gpu)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def _write(calibration, out: Path) -> None:
    from traces.atomic import replacing_file

    out.parent.mkdir(parents=True, exist_ok=True)
    with replacing_file(out) as tmp:
        Path(tmp).write_text(json.dumps(calibration.to_json(), indent=2) + "\n")


def _terms_line(terms) -> str:
    """The fitted terms; an optional term (``--add``) only where it was fitted, with where it
    starts, so a default fit prints what it always printed."""
    from sim.serving.step_fit import OPTIONAL_TERMS

    values = terms.to_dict()
    for term in OPTIONAL_TERMS:
        if not values.get(term):
            del values[term]
    if "per_exposed_kv_token_s" not in values:  # where that term starts: nothing without it
        del values["num_hidden_kv_tokens"]
    return "terms: " + ", ".join(f"{name} {value:.4g}" for name, value in values.items())


_common = [
    model_option("Model preset or JSON file the engine ran."),
    gpu_option("GPU preset or JSON file the engine ran on."),
    click.option(
        "--tp",
        "tensor_parallel",
        type=COUNT,
        default=None,
        help="Tensor-parallel degree the engine ran (default: the profiles' tp column, else 1).",
    ),
    engine_option(
        "Engine preset whose scheduling the simulator mimics (sim/data/engines.json).",
        default="transformers",
    ),
    out_file_option("Calibration JSON to write (simulate --calibration reads it).", name="out"),
]


def _with_common(command):
    for option in reversed(_common):
        command = option(command)
    return command


def _engine(name: str) -> str:
    from sim.serving.engines import load_engine

    try:
        return load_engine(name).name
    except ValueError as exc:
        raise UsageError(f"--engine: {exc}") from None


@calibrate_group.command("steps")
@click.argument(
    "profiles", nargs=-1, required=True, type=click.Path(dir_okay=False, path_type=Path)
)
@_with_common
@click.option(
    "--drop",
    "drop",
    multiple=True,
    metavar="TERM",
    help="Hold a term at 0 instead of fitting it (repeatable): fixed_s, per_seq_s, per_token_s, "
    "per_kv_token_s, per_pair_s, per_query_kv_s, per_exposed_kv_token_s.",
)
@click.option(
    "--add",
    "add",
    multiple=True,
    metavar="TERM",
    help="Fit an optional term even where it gains less than 1 % of the fit's loss (repeatable): "
    "per_exposed_kv_token_s (each KV token past those the kernel launches hide; "
    "it also fits where that starts).",
)
def steps_command(profiles, model, gpu, tensor_parallel, engine, out: Path, drop, add) -> None:
    """Fit the step time to an engine's step PROFILES (CSV or Parquet, one row per step). Several
    profiles (recordings of one engine) are pooled: one fit over all their steps, its error
    printed for the pool and for each profile."""
    from sim.serving.step_fit import OUTLIER_REL_ERROR, ROBUST_REL_ERROR, fit_step_profile
    from sim.replay.schema import format_table
    from traces.engine_profile import read_step_profile

    engine = _engine(engine)
    model_spec, gpu_spec = _specs(model, gpu)
    resolved = [p.resolve() for p in profiles]
    twice = [p for p, r in zip(profiles, resolved) if resolved.count(r) > 1]
    if twice:
        raise UsageError(f"{twice[0]}: given twice (each profile is pooled once)")
    pool = {str(path): read_step_profile(path) for path in profiles}
    what = " + ".join(pool)
    if tensor_parallel is None:
        tps = {
            name: sorted({int(tp) for tp in steps["tp"]}) if "tp" in steps else [1]
            for name, steps in pool.items()
        }
        degrees = sorted({tp for found in tps.values() for tp in found})
        if len(degrees) > 1:
            where = "; ".join(f"{name}: {found}" for name, found in tps.items())
            raise UsageError(
                f"the tp column holds {degrees} ({where}); "
                "fit one tensor-parallel degree at a time (--tp)"
            )
        tensor_parallel = int(degrees[0])
    try:
        fit = fit_step_profile(
            pool if len(pool) > 1 else next(iter(pool.values())),
            model_spec,
            gpu_spec,
            tensor_parallel=tensor_parallel,
            drop=drop,
            add=add,
            engine=engine,
            source=what,
        )
    except ValueError as exc:
        raise UsageError(f"{what}: {exc}") from None
    _write(fit.calibration, out)
    pooled = f" pooled from {len(pool)} profiles" if len(pool) > 1 else ""
    click.echo(
        f"{what}: {fit.num_steps:,} steps{pooled} of {model_spec.name} on {gpu_spec.name} "
        f"(tp {tensor_parallel}); {fit.num_outliers} outlier(s) left out of the fit "
        f"(more than {OUTLIER_REL_ERROR:.0%} off its first pass), {fit.num_downweighted} more "
        f"than {ROBUST_REL_ERROR:.0%} off weighed less (Huber loss)"
        + (
            f"; first step {fit.calibration.warmup_s:.3f} s beyond its terms, kept as warm-up"
            + (" (the median over the profiles that started cold)" if pooled else "")
            if fit.calibration.warmup_s
            else ""
        )
    )
    click.echo(_terms_line(fit.terms))
    # what simulate checks its steps against (sim.serving.fit_range): the fit carries this far
    click.echo(fit.calibration.fitted_range.describe())
    columns = ["split", "kind", "n_steps", "mean_abs_err_%", "sum_bias_%"]
    click.echo(
        "step-time error by step kind (mean |predicted/measured - 1|, and the bias of their sum)"
        + (" over the pool" if pooled else "")
        + ":"
    )
    click.echo(format_table(fit.errors, columns=columns))
    if pooled:
        click.echo(
            "... and by profile (fit on the other profiles: each profile predicted "
            "by the terms of the others, the error to expect on a new recording):"
        )
        names = {name: Path(name).name for name in pool}
        if len(set(names.values())) < len(names):  # two folders' files of one name: the paths
            names = {name: name for name in pool}
        by_profile = fit.profile_errors.assign(profile=fit.profile_errors["profile"].map(names))
        click.echo(format_table(by_profile, columns=["profile", *columns]))
    click.echo(f"wrote {out} (simulate --engine {engine} --calibration {out})")


@calibrate_group.command("requests")
@click.argument("requests", type=click.Path(dir_okay=False, path_type=Path))
@_with_common
@click.option(
    "--max-evaluations",
    type=Count(10),
    default=200,
    show_default=True,
    help="Simulations the fit may run (each serves the whole table).",
)
def requests_command(
    requests: Path, model, gpu, tensor_parallel, engine, out: Path, max_evaluations: int
) -> None:
    """Infer the step time from a served-request table REQUESTS alone (arrival, first token, finish,
    tokens)."""
    from sim.serving.engine_runs import fit_from_requests
    from sim.replay.schema import format_table
    from traces.engine_profile import read_served_requests

    engine = _engine(engine)
    model_spec, gpu_spec = _specs(model, gpu)
    served = read_served_requests(requests)
    try:
        fit = fit_from_requests(
            served,
            engine=engine,
            model=model_spec,
            gpu=gpu_spec,
            tensor_parallel=tensor_parallel or 1,
            source=str(requests),
            max_evaluations=max_evaluations,
        )
    except ValueError as exc:
        raise UsageError(f"{requests}: {exc}") from None
    _write(fit.calibration, out)
    click.echo(
        f"{requests}: {len(served):,} requests of {model_spec.name} on {gpu_spec.name}, "
        f"simulated as {engine} schedules them"
    )
    click.echo(_terms_line(fit.calibration.terms))
    click.echo(fit.calibration.fitted_range.describe())
    click.echo("fitted on every request (in-sample):")
    click.echo(format_table(fit.errors, columns=["metric", "measured_s", "predicted_s", "error_%"]))
    worst = fit.cv_errors.groupby("metric", sort=False)["error_%"].apply(lambda e: e.abs().max())
    click.echo(
        "expected error (two-fold: each half of the requests judged by terms fitted on "
        "the other half; worst half): " + ", ".join(f"{m} {v:.0f} %" for m, v in worst.items())
    )
    click.echo(f"wrote {out} (simulate --engine {engine} --calibration {out})")
