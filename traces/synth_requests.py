"""Seeded synthetic request traces: Poisson or Gamma arrivals, token lengths from a distribution.

``synth_requests(num_requests=1000, rate_rps=4, arrival="gamma", cv=2.0, prompt=Lognormal(1000,
1.0), output=Zipf(1.2, max=2048), seed=0)`` gives the same trace for the same arguments on every
machine (numpy ``Generator``; arrivals, prompt lengths, output lengths and prefixes draw from
separate child streams, so changing one distribution leaves the others' draws unchanged).

Length distributions are written on the command line as ``name:key=value,...``
(``parse_length_dist``): ``lognormal:median=1000,sigma=1.0[,min=1,max=32768]``,
``zipf:a=1.2[,min=1,max=65536]``, ``fixed:n=128`` (or just ``128``),
``empirical:trace=FILE,column=prompt_tokens`` (lengths resampled from a real trace).

Every trace generated here reads back: the specs hold the limits the readers hold
(``traces.requests.MAX_TOKENS`` per request, ``MAX_TIME_S`` of arrivals), so a spec that could
draw more is refused when it is built, and a drawn trace that would last longer is refused
before it is returned.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import math

import numpy as np

from traces.requests import MAX_TIME_S, MAX_TOKENS, RequestTrace, make_requests
from traces.spec_grammar import MAX_SPEC_DEPTH, check_text, parse_items, unbracket

__all__ = [
    "LengthDist",
    "Lognormal",
    "Zipf",
    "Empirical",
    "Fixed",
    "PrefixSharing",
    "parse_length_dist",
    "parse_prefix_sharing",
    "synth_requests",
]

_MAX_ZIPF_RANGE = 10_000_000  # the bounded Zipf keeps its whole CDF in memory
# Gamma gaps of shape 1/cv**2: near 0 the shape overflows, far above 1 every gap is 0 but a few
_MIN_CV, _MAX_CV = 1e-3, 1e3
#: Most requests one synthetic trace may have: about 200 B each in the table (a session id and a
#: hash-id tuple per row), so 10 million is 2 GB; more is refused before any work.
MAX_REQUESTS = 10_000_000
#: Longest length or prefix-sharing spec read (the longest in the docs is under 100 characters):
#: longer is a runaway, and every error message repeats the spec.
MAX_SPEC_CHARS = 1000


class LengthDist(Protocol):
    """A distribution of token counts (all values >= 1)."""

    def sample(self, rng: np.random.Generator, size: int) -> np.ndarray: ...


def _check_whole(
    kind: str, key: str, value: Any, *, low: int = 1, high: int = MAX_TOKENS, unit: str = "tokens"
) -> None:
    """Refuse a knob that is not a whole number in ``[low, high]`` (a bool is not a number here)."""
    if (
        isinstance(value, (bool, np.bool_))
        or not isinstance(value, (int, float, np.integer, np.floating))
        or not math.isfinite(value)
        or int(value) != value
        or value < low
    ):
        raise ValueError(f"{kind}: {key}={value!r} must be a whole number >= {low}")
    if value > high:
        raise ValueError(
            f"{kind}: {key}={value!r} is more than {high:,} {unit}, "
            "the most a request trace may hold"
        )


def _check_bounds(kind: str, lo: int, hi: int | None) -> None:
    _check_whole(kind, "min", lo)
    if hi is not None:
        _check_whole(kind, "max", hi)
        if hi < lo:
            raise ValueError(f"{kind}: max={hi!r} must be a whole number >= min={lo}")


@dataclass(frozen=True)
class Lognormal:
    """Tokens = round(exp(N(ln median, sigma))), clipped to [min, max] (max: ``MAX_TOKENS`` if not
    given)."""

    median: float
    sigma: float
    min: int = 1
    max: int | None = None

    def __post_init__(self) -> None:
        if not (np.isfinite(self.median) and self.median > 0):
            raise ValueError(f"lognormal: median={self.median!r} must be > 0")
        if self.median > MAX_TOKENS:
            raise ValueError(
                f"lognormal: median={self.median!r} is more than {MAX_TOKENS:,} tokens, "
                "the most a request trace may hold"
            )
        if not (np.isfinite(self.sigma) and self.sigma >= 0):
            raise ValueError(f"lognormal: sigma={self.sigma!r} must be >= 0")
        _check_bounds("lognormal", self.min, self.max)

    def sample(self, rng: np.random.Generator, size: int) -> np.ndarray:
        """Draws clipped to ``[min, max]``; without a max, to ``MAX_TOKENS`` (a huge sigma overflows
        to inf)."""
        x = np.rint(rng.lognormal(np.log(self.median), self.sigma, size))
        return np.clip(x, self.min, self.max if self.max is not None else MAX_TOKENS).astype(
            np.int64
        )


@dataclass(frozen=True)
class Zipf:
    """P(k) proportional to k**-a for whole k in [min, max] (bounded, so any a > 0 works)."""

    a: float
    min: int = 1
    max: int = 65536

    def __post_init__(self) -> None:
        if not (np.isfinite(self.a) and self.a > 0):
            raise ValueError(f"zipf: a={self.a!r} must be > 0")
        _check_bounds("zipf", self.min, self.max)
        if self.max - self.min >= _MAX_ZIPF_RANGE:
            raise ValueError(
                f"zipf: range [{self.min}, {self.max}] is wider than {_MAX_ZIPF_RANGE:,} values"
            )

    def sample(self, rng: np.random.Generator, size: int) -> np.ndarray:
        k = np.arange(self.min, self.max + 1, dtype=np.float64)
        cdf = np.cumsum(k**-self.a)
        idx = np.searchsorted(cdf, rng.random(size) * cdf[-1], side="right")
        return (self.min + np.minimum(idx, k.size - 1)).astype(np.int64)


@dataclass(frozen=True, repr=False)
class Empirical:
    """Resample (uniformly, with replacement) from observed lengths, e.g. a real trace's column."""

    values: np.ndarray = field(compare=False)

    def __repr__(self) -> str:
        return f"Empirical(<{self.values.size} values, median {float(np.median(self.values)):g}>)"

    def __post_init__(self) -> None:
        v = np.asarray(self.values)
        if v.ndim != 1 or v.size == 0:
            raise ValueError("empirical: needs a non-empty list of lengths")
        if (
            not np.issubdtype(v.dtype, np.number)
            or v.dtype == bool
            or np.any(v < 1)
            or np.any(v != np.floor(v))
        ):
            raise ValueError("empirical: lengths must be whole numbers >= 1")
        if np.any(v > MAX_TOKENS):
            raise ValueError(
                f"empirical: length {v.max()!r} is more than {MAX_TOKENS:,} tokens, "
                "the most a request trace may hold"
            )
        object.__setattr__(self, "values", v.astype(np.int64))

    def sample(self, rng: np.random.Generator, size: int) -> np.ndarray:
        return self.values[rng.integers(0, self.values.size, size)]


@dataclass(frozen=True)
class Fixed:
    """Every request has exactly ``n`` tokens."""

    n: int

    def __post_init__(self) -> None:
        _check_whole("fixed", "n", self.n)

    def sample(self, rng: np.random.Generator, size: int) -> np.ndarray:
        return np.full(size, int(self.n), dtype=np.int64)


@dataclass(frozen=True)
class PrefixSharing:
    """Shared system prompts: requests reuse the hash ids of a few common prefixes.

    Each prefix k has a length drawn once from ``prefix_tokens``; a request picks one (with
    probability ``fraction``; prefix k with weight (k+1)**-a, Zipf) and its first
    ``min(prefix length, prompt length) // block_tokens`` blocks carry that prefix's ids. The
    rest of its prompt gets fresh ids. Prompt lengths are not changed by sharing.
    """

    num_prefixes: int = 4
    prefix_tokens: Any = Fixed(2048)
    a: float = 1.0
    fraction: float = 1.0
    block_tokens: int = 512

    def __post_init__(self) -> None:
        # a prefix more than there are requests is never used; a count past that only costs memory
        _check_whole(
            "prefix sharing", "num_prefixes", self.num_prefixes, high=MAX_REQUESTS, unit="prefixes"
        )
        if not (np.isfinite(self.a) and self.a >= 0):
            raise ValueError(f"prefix sharing: a={self.a!r} must be >= 0")
        if not 0.0 <= self.fraction <= 1.0:
            raise ValueError(f"prefix sharing: fraction={self.fraction!r} must be in [0, 1]")
        _check_whole("prefix sharing", "block_tokens", self.block_tokens)

    def hash_ids(
        self, rng: np.random.Generator, prompt_tokens: np.ndarray
    ) -> list[tuple[int, ...]]:
        bt = int(self.block_tokens)
        prefix_blocks = self.prefix_tokens.sample(rng, self.num_prefixes) // bt
        first_id = np.concatenate(
            [[0], np.cumsum(prefix_blocks)]
        )  # prefix k owns ids first_id[k]..
        weights = np.arange(1, self.num_prefixes + 1, dtype=np.float64) ** -self.a
        choice = rng.choice(self.num_prefixes, size=prompt_tokens.size, p=weights / weights.sum())
        uses = rng.random(prompt_tokens.size) < self.fraction
        next_id = int(first_id[-1])
        out = []
        for n_tokens, k, use in zip(prompt_tokens.tolist(), choice.tolist(), uses.tolist()):
            num_blocks = -(-n_tokens // bt)
            shared = min(int(prefix_blocks[k]), n_tokens // bt) if use else 0
            own = num_blocks - shared
            out.append(
                tuple(range(first_id[k], first_id[k] + shared))
                + tuple(range(next_id, next_id + own))
            )
            next_id += own
        return out


def synth_requests(
    *,
    num_requests: int | None = None,
    duration_s: float | None = None,
    rate_rps: float,
    arrival: str = "poisson",
    cv: float = 1.0,
    prompt: LengthDist = Lognormal(1000, 1.0),
    output: LengthDist = Lognormal(128, 1.0),
    seed: int = 0,
    prefix_sharing: PrefixSharing | None = None,
    name: str = "synth",
) -> RequestTrace:
    """A synthetic request trace.

    Args:
        num_requests: how many requests; with ``duration_s`` too, at most this many.
        duration_s: keep arrivals in ``[0, duration_s)`` (the first request arrives at 0).
        rate_rps: mean arrival rate, requests per second.
        arrival: ``"poisson"`` (exponential gaps, CV 1) or ``"gamma"`` (gaps Gamma-distributed with
            coefficient of variation ``cv``: shape 1/cv**2, so cv > 1 is burstier than Poisson).
        prompt, output: token-length distributions (``Lognormal``, ``Zipf``, ``Empirical``,
            ``Fixed``).
        seed: the same seed and arguments give the same trace.
        prefix_sharing: share prompt-prefix hash ids among requests; None for no hash ids.
        name: name for reports.
    """
    if num_requests is None and duration_s is None:
        raise ValueError("synth_requests needs num_requests or duration_s (or both)")
    if num_requests is not None and (int(num_requests) != num_requests or num_requests < 0):
        raise ValueError(f"num_requests={num_requests!r} must be a whole number >= 0")
    if duration_s is not None and not (np.isfinite(duration_s) and duration_s > 0):
        raise ValueError(f"duration_s={duration_s!r} must be a finite number > 0")
    if duration_s is not None and duration_s > MAX_TIME_S:
        raise ValueError(
            f"duration_s={duration_s!r} is longer than {MAX_TIME_S:g} s, "
            "the most a request trace may last"
        )
    if not (np.isfinite(rate_rps) and rate_rps > 0):
        raise ValueError(f"rate_rps={rate_rps!r} must be a finite number > 0")
    if duration_s is None and num_requests > 1 and (num_requests - 1) / rate_rps > MAX_TIME_S:
        raise ValueError(
            f"num_requests={num_requests:,} at rate_rps={rate_rps!r} would last "
            f"about {(num_requests - 1) / rate_rps:.3g} s, longer than {MAX_TIME_S:g} s; "
            "raise the rate"
        )
    expected = num_requests if num_requests is not None else rate_rps * duration_s
    if duration_s is not None and num_requests is not None:
        expected = min(num_requests, rate_rps * duration_s)
    if expected > MAX_REQUESTS:  # refused before any work: the table would not fit in memory
        raise ValueError(
            f"num_requests={expected:,.0f} "
            f"(or rate_rps x duration_s) is more than {MAX_REQUESTS:,} requests; "
            "generate fewer, or several traces"
        )
    if arrival not in ("poisson", "gamma"):
        raise ValueError(f"arrival={arrival!r} must be 'poisson' or 'gamma'")
    if not (np.isfinite(cv) and cv > 0):
        raise ValueError(f"cv={cv!r} must be a finite number > 0")
    if not _MIN_CV <= cv <= _MAX_CV:
        raise ValueError(
            f"cv={cv!r} must be between {_MIN_CV:g} and {_MAX_CV:g} (the Gamma shape is 1/cv**2)"
        )
    if arrival == "poisson" and cv != 1.0:
        raise ValueError(f"cv={cv!r} needs arrival='gamma' (a Poisson process has CV 1)")
    rng_arrival, rng_prompt, rng_output, rng_prefix = (
        np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(4)
    )
    t = _arrivals(rng_arrival, num_requests, duration_s, rate_rps, arrival, cv)
    if t.size and not t[-1] <= MAX_TIME_S:  # a bursty (gamma) draw can outrun the expected span
        raise ValueError(
            f"the arrivals drawn last {t[-1]:.3g} s, longer than {MAX_TIME_S:g} s; "
            "raise rate_rps or lower cv"
        )
    prompt_tokens = prompt.sample(rng_prompt, t.size)
    output_tokens = output.sample(rng_output, t.size)
    hash_ids = prefix_sharing.hash_ids(rng_prefix, prompt_tokens) if prefix_sharing else None
    meta: dict[str, Any] = {
        "seed": seed,
        "rate_rps": rate_rps,
        "arrival": arrival,
        "cv": cv,
        "num_requests": num_requests,
        "duration_s": duration_s,
        "prompt": _describe_dist(prompt),
        "output": _describe_dist(output),
        "prefix_sharing": None
        if prefix_sharing is None
        else {
            **asdict(prefix_sharing),
            "prefix_tokens": _describe_dist(prefix_sharing.prefix_tokens),
        },
    }
    if prefix_sharing is not None:
        meta["hash_block_tokens"] = int(prefix_sharing.block_tokens)
    return RequestTrace(
        make_requests(t, prompt_tokens, output_tokens, hash_ids=hash_ids),
        name=name,
        source="",
        format="synth",
        meta=meta,
    )


def _arrivals(
    rng: np.random.Generator,
    num_requests: int | None,
    duration_s: float | None,
    rate_rps: float,
    arrival: str,
    cv: float,
) -> np.ndarray:
    """Arrival times of a renewal process with an arrival at 0 and mean gap 1/rate_rps."""

    def gaps(size: int) -> np.ndarray:
        if arrival == "poisson":
            return rng.exponential(1.0 / rate_rps, size)
        shape = 1.0 / cv**2
        return rng.gamma(shape, 1.0 / (rate_rps * shape), size)

    if duration_s is None:
        n = int(num_requests)
        return np.concatenate([[0.0], np.cumsum(gaps(n - 1))]) if n else np.zeros(0)
    limit = np.inf if num_requests is None else int(num_requests)
    chunks, t_last, count = [np.zeros(1)], 0.0, 1
    while t_last < duration_s and count < limit:
        # draw in chunks about the expected count, so the loop runs once or twice
        t = t_last + np.cumsum(gaps(int(rate_rps * duration_s * 1.1) + 16))
        chunks.append(t)
        t_last, count = float(t[-1]), count + t.size
    t = np.concatenate(chunks)
    t = t[t < duration_s]
    return t[: int(min(limit, t.size))]


def _describe_dist(dist: Any) -> str:
    return repr(dist)


def _parse_kv(text: str, kind: str, body: str) -> dict[str, str]:
    return parse_items(
        body,
        valid_key=bool,
        need_value=True,
        bad_item=lambda part: ValueError(
            f"cannot read {part!r} in {kind} spec {text!r}: expected key=value"
        ),
    )


def _check_spec(spec: str, kind: str, *, brackets: bool = True) -> str:
    """The spec stripped, unless it is longer than ``MAX_SPEC_CHARS`` (or, with ``brackets``, its
    brackets are unbalanced or nested too deep)."""
    spec = str(spec).strip()
    check_text(
        spec,
        f"{kind} spec",
        max_chars=MAX_SPEC_CHARS,
        max_depth=MAX_SPEC_DEPTH if brackets else None,
    )
    return spec


def _number(text: str, spec: str, key: str, kind: type = float) -> Any:
    try:
        value = float(text.replace("_", ""))
    except ValueError:
        raise ValueError(f"{key}={text!r} in {spec!r} is not a number") from None
    if not math.isfinite(value):  # "1e400" and 400 digits read as inf
        raise ValueError(f"{key}={text!r} in {spec!r} is not a finite number")
    if kind is int:
        if value != int(value):
            raise ValueError(f"{key}={text!r} in {spec!r} is not a whole number")
        return int(value)
    return value


_DIST_KEYS = {
    "lognormal": (
        Lognormal,
        {"median": float, "sigma": float, "min": int, "max": int},
        ("median", "sigma"),
    ),
    "zipf": (Zipf, {"a": float, "min": int, "max": int}, ("a",)),
    "fixed": (Fixed, {"n": int}, ("n",)),
}


def parse_length_dist(text: str) -> LengthDist:
    """``"lognormal:median=1000,sigma=1.0"`` -> ``Lognormal(1000.0, 1.0)``; ValueError naming the
    text if not."""
    spec = _check_spec(text, "length distribution")
    kind, _, body = spec.partition(":")
    kind = kind.strip().lower()
    if kind.replace("_", "").isdigit() and not body:
        return Fixed(_number(kind, spec, "n", int))
    if kind == "fixed" and body and "=" not in body:
        body = f"n={body}"
    if kind == "empirical":
        kv = _parse_kv(spec, kind, body)
        unknown = set(kv) - {"trace", "column"}
        if unknown or "trace" not in kv:
            raise ValueError(
                f"empirical spec {spec!r} needs trace=FILE[,column=prompt_tokens|output_tokens]"
            )
        column = kv.get("column", "prompt_tokens")
        column = {"prompt": "prompt_tokens", "output": "output_tokens"}.get(column, column)
        if column not in ("prompt_tokens", "output_tokens"):
            raise ValueError(
                f"empirical spec {spec!r}: column must be prompt_tokens or output_tokens"
            )
        from traces.request_readers import read_request_trace

        return Empirical(read_request_trace(kv["trace"]).requests[column].to_numpy())
    if kind not in _DIST_KEYS:
        raise ValueError(
            f"unknown length distribution {kind!r} in {spec!r}; "
            "known: lognormal, zipf, fixed, empirical (e.g. lognormal:median=1000,sigma=1.0)"
        )
    cls, keys, required = _DIST_KEYS[kind]
    kv = _parse_kv(spec, kind, body)
    unknown = sorted(set(kv) - set(keys))
    if unknown:
        raise ValueError(
            f"unknown key(s) {', '.join(unknown)} in {spec!r}; {kind} takes {', '.join(keys)}"
        )
    missing = [k for k in required if k not in kv]
    if missing:
        raise ValueError(
            f"{spec!r} lacks {', '.join(missing)} (e.g. "
            f"{kind}:{','.join(f'{k}=...' for k in required)})"
        )
    return cls(**{k: _number(v, spec, k, keys[k]) for k, v in kv.items()})


def parse_prefix_sharing(text: str) -> PrefixSharing:
    """``"num_prefixes=8,prefix_tokens=[lognormal:median=2048,sigma=0.5],a=1.0,fraction=0.9,block_tokens=512"``.

    ``prefix_tokens`` takes a length spec in square brackets (or a plain number of tokens); no
    other brackets are read, so they may not nest.
    """
    spec = _check_spec(text, "prefix-sharing", brackets=False)
    depth = 0
    for i, ch in enumerate(spec):  # one level, named by position: more than check_text would say
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if not 0 <= depth <= 1:
            raise ValueError(
                f"prefix-sharing spec {spec!r}: "
                f"{'unbalanced' if depth < 0 else 'nested'} '{ch}' at character {i + 1}; "
                "only prefix_tokens=[...] takes brackets, one level"
            )
    if depth:
        raise ValueError(f"prefix-sharing spec {spec!r}: unbalanced '['")
    types = {"num_prefixes": int, "a": float, "fraction": float, "block_tokens": int}
    kv: dict[str, Any] = {}
    for key, value in _parse_kv(spec, "prefix-sharing", spec).items():
        if key == "prefix_tokens":
            kv[key] = parse_length_dist(unbracket(value))
        elif key in types:
            kv[key] = _number(value, spec, key, types[key])
        else:
            raise ValueError(
                f"unknown key {key!r} in prefix-sharing spec {spec!r}; known: prefix_tokens, "
                f"{', '.join(types)}"
            )
    return PrefixSharing(**kv)
