"""The one progress bar of every long command: on a terminal only, on stderr.

``progress_bar`` is what ``replay``, ``simulate``, ``gpu replay``, ``colocate``, ``fidelity`` (and
``plan``, ``serve``) show while they work: a ``tqdm`` bar that appears only when stderr is a
terminal (``disable=None``), so piped or redirected output stays clean, and that leaves no line
behind when it closes. ``enabled=False`` (the commands' ``--no-progress``) gives a bar that
does nothing, with the same methods, so callers never test for one.

Work done in worker processes is counted with ``SharedCounts`` (one slot a job, written by its
worker, summed by the parent that draws the bar).
"""

from __future__ import annotations

import contextlib
import multiprocessing
from typing import Any, Callable, Iterator

__all__ = ["progress_bar", "time_bar", "NullBar", "SharedCounts"]


class NullBar:
    """A bar that shows nothing (``enabled=False``): ``update``/``set_description``/``close`` do
    nothing."""

    n = 0

    def update(self, n: float = 1) -> None:
        self.n += n

    def set_description(self, desc: str) -> None:
        pass

    def set_postfix_str(self, text: str) -> None:
        pass

    def refresh(self) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self) -> "NullBar":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def progress_bar(
    total: float | None,
    desc: str,
    *,
    unit: str = "ev",
    enabled: bool = True,
    unit_scale: bool = True,
    bar_format: str | None = None,
    file: Any = None,
) -> Any:
    """A bar over ``total`` units titled ``desc``, drawn on ``file`` (stderr) only if it is a
    terminal.

    Args:
        total: units of the whole job (events, simulated seconds, requests); None if unknown.
        desc: what is being done ("trace · policy").
        unit: the unit's name in the bar.
        enabled: False for ``--no-progress``: a ``NullBar``.
        unit_scale: 1.2M rather than 1,200,000.
        bar_format: tqdm's format string, when the default does not suit the unit.
        file: where to draw (stderr by default; tests pass a terminal stand-in).
    """
    if not enabled:
        return NullBar()
    from tqdm.auto import tqdm

    kwargs: dict[str, Any] = {} if bar_format is None else {"bar_format": bar_format}
    # disable=None: only on a terminal (piped output stays readable); mininterval: redraw at most
    # twice a second
    return tqdm(
        total=total,
        desc=desc,
        unit=unit,
        unit_scale=unit_scale,
        leave=False,
        mininterval=0.5,
        disable=None,
        file=file,
        **kwargs,
    )


@contextlib.contextmanager
def time_bar(
    total_s: float, desc: str, *, enabled: bool = True
) -> Iterator[Callable[[float], None] | None]:
    """A bar in simulated seconds up to ``total_s``, and the callback that moves it to a
    simulated time (``advance(now_s)``; times past ``total_s`` stop at its end); None when not
    ``enabled``, for callers that then skip their hook altogether."""
    if not enabled:
        yield None
        return
    total_s = max(float(total_s), 1e-9)
    with progress_bar(
        round(total_s, 1),
        desc,
        unit="sim-s",
        unit_scale=False,
        bar_format="{l_bar}{bar}| {n:,.0f}/{total:,.0f} sim-s [{elapsed}<{remaining}]",
    ) as bar:

        def advance(now_s: float) -> None:
            bar.update(round(min(now_s, total_s), 1) - bar.n)

        yield advance


class SharedCounts:
    """Units done per job, in memory shared with forked workers: worker ``job`` calls
    ``counts.add(job, n)``; the parent reads ``total()`` to move its bar. One writer per slot,
    so no lock is needed."""

    def __init__(self, num_jobs: int, context: Any = None):
        ctx = context or multiprocessing.get_context()
        self._slots = ctx.RawArray("q", max(1, num_jobs))

    def add(self, job: int, n: int) -> None:
        self._slots[job] += n

    def total(self) -> int:
        return sum(self._slots)
