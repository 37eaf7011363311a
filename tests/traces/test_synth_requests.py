import numpy as np
import pandas as pd
import pytest

from traces.request_readers import read_request_trace, write_request_trace
from traces.requests import validate_requests
from traces.synth_requests import (
    Empirical,
    Fixed,
    Lognormal,
    PrefixSharing,
    Zipf,
    parse_length_dist,
    parse_prefix_sharing,
    synth_requests,
)


def _cv(trace) -> float:
    gaps = np.diff(trace.requests["arrival_s"].to_numpy())
    return float(gaps.std() / gaps.mean())


def test_same_seed_same_trace():
    kw = dict(
        num_requests=500,
        rate_rps=3.0,
        arrival="gamma",
        cv=2.0,
        prompt=Zipf(1.1, max=4096),
        prefix_sharing=PrefixSharing(),
        seed=7,
    )
    pd.testing.assert_frame_equal(synth_requests(**kw).requests, synth_requests(**kw).requests)


def test_different_seed_different_trace():
    a = synth_requests(num_requests=100, rate_rps=1.0, seed=1).requests
    b = synth_requests(num_requests=100, rate_rps=1.0, seed=2).requests
    assert not np.array_equal(a["arrival_s"], b["arrival_s"])


def test_changing_output_dist_keeps_arrivals_and_prompts():
    a = synth_requests(num_requests=200, rate_rps=2.0, output=Fixed(5), seed=3).requests
    b = synth_requests(num_requests=200, rate_rps=2.0, output=Lognormal(300, 0.5), seed=3).requests
    assert np.array_equal(a["arrival_s"], b["arrival_s"])
    assert np.array_equal(a["prompt_tokens"], b["prompt_tokens"])


def test_synth_trace_is_valid_and_starts_at_zero():
    tr = synth_requests(num_requests=300, rate_rps=10.0, seed=0, prefix_sharing=PrefixSharing())
    validate_requests(tr.requests)
    assert tr.format == "synth" and tr.meta["seed"] == 0 and tr.meta["hash_block_tokens"] == 512


def test_poisson_rate_and_cv():
    tr = synth_requests(num_requests=20_000, rate_rps=4.0, seed=11)
    assert (len(tr) - 1) / tr.duration_s == pytest.approx(4.0, rel=0.03)
    assert _cv(tr) == pytest.approx(1.0, abs=0.04)


@pytest.mark.parametrize("cv", [0.5, 2.0, 4.0])
def test_gamma_cv(cv):
    tr = synth_requests(num_requests=20_000, rate_rps=4.0, arrival="gamma", cv=cv, seed=5)
    assert _cv(tr) == pytest.approx(cv, rel=0.1)
    assert (len(tr) - 1) / tr.duration_s == pytest.approx(4.0, rel=0.1)


def test_duration_window():
    tr = synth_requests(duration_s=500.0, rate_rps=20.0, seed=2)
    assert tr.duration_s < 500.0
    assert len(tr) == pytest.approx(10_000, rel=0.05)


def test_num_requests_caps_a_duration():
    tr = synth_requests(num_requests=50, duration_s=1000.0, rate_rps=20.0, seed=2)
    assert len(tr) == 50


def test_rate_scale_of_synth_trace_doubles_rate():
    tr = synth_requests(num_requests=1000, rate_rps=2.0, seed=4)
    assert tr.scale_rate(2.0).duration_s == pytest.approx(tr.duration_s / 2)


def test_lognormal_median_and_bounds():
    x = Lognormal(1000, 1.0, min=10, max=20_000).sample(np.random.default_rng(0), 50_000)
    assert np.median(x) == pytest.approx(1000, rel=0.05)
    assert x.min() >= 10 and x.max() <= 20_000 and x.dtype == np.int64


def test_zipf_bounds_and_shape():
    x = Zipf(1.5, min=1, max=100).sample(np.random.default_rng(0), 100_000)
    assert x.min() >= 1 and x.max() <= 100
    counts = np.bincount(x)
    assert counts[1] / counts[2] == pytest.approx(2**1.5, rel=0.08)


def test_empirical_resamples_given_values():
    x = Empirical([3, 30, 300]).sample(np.random.default_rng(0), 1000)
    assert set(np.unique(x)) == {3, 30, 300}


def test_fixed_is_constant():
    assert set(Fixed(64).sample(np.random.default_rng(0), 10)) == {64}


def test_prefix_sharing_shares_only_leading_blocks():
    sharing = PrefixSharing(num_prefixes=3, prefix_tokens=Fixed(1024), block_tokens=256)
    tr = synth_requests(
        num_requests=400, rate_rps=1.0, prompt=Lognormal(800, 1.0), prefix_sharing=sharing, seed=9
    )
    prefix_ids = set(range(3 * 4))  # 3 prefixes x 1024 // 256 blocks, numbered first
    seen_other: set[int] = set()
    for prompt, ids in zip(tr.requests["prompt_tokens"], tr.requests["hash_ids"]):
        assert len(ids) == -(-prompt // 256)
        shared = [i for i in ids if i in prefix_ids]
        assert list(ids[: len(shared)]) == shared and len(shared) == min(4, prompt // 256)
        own = set(ids[len(shared) :])
        assert not own & seen_other  # a request's own blocks are never reused
        seen_other |= own
    assert tr.describe()["hash_block_reuse_frac"] > 0.3


def test_prefix_sharing_fraction_zero_shares_nothing():
    tr = synth_requests(
        num_requests=200, rate_rps=1.0, prefix_sharing=PrefixSharing(fraction=0.0), seed=1
    )
    assert tr.describe()["hash_block_reuse_frac"] == 0.0


def test_write_and_read_back_synth_trace(tmp_path):
    tr = synth_requests(num_requests=100, rate_rps=1.0, prefix_sharing=PrefixSharing(), seed=1)
    back = read_request_trace(write_request_trace(tr, tmp_path / "s.parquet"))
    pd.testing.assert_frame_equal(back.requests, tr.requests)
    assert back.meta["arrival"] == "poisson"


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(rate_rps=1.0), "num_requests or duration_s"),
        (dict(num_requests=10, rate_rps=0.0), "rate_rps"),
        (dict(num_requests=10, rate_rps=1.0, arrival="weibull"), "arrival"),
        (dict(num_requests=10, rate_rps=1.0, cv=2.0), "gamma"),
        (dict(num_requests=10, rate_rps=1.0, arrival="gamma", cv=-1.0), "cv"),
        (dict(num_requests=-1, rate_rps=1.0), "num_requests"),
        (dict(duration_s=0.0, rate_rps=1.0), "duration_s"),
    ],
)
def test_bad_arguments_are_value_errors(kw, match):
    with pytest.raises(ValueError, match=match):
        synth_requests(**kw)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("lognormal:median=1000,sigma=1.0", Lognormal(1000.0, 1.0)),
        ("lognormal:median=500,sigma=0.5,min=16,max=4096", Lognormal(500.0, 0.5, 16, 4096)),
        ("zipf:a=1.2,max=2048", Zipf(1.2, max=2048)),
        ("fixed:n=128", Fixed(128)),
        ("fixed:64", Fixed(64)),
        ("256", Fixed(256)),
    ],
)
def test_parse_length_dist(text, expected):
    assert parse_length_dist(text) == expected


@pytest.mark.parametrize(
    "text, match",
    [
        ("lognormal:median=1000", "lacks sigma"),
        ("gauss:mu=1", "unknown length distribution 'gauss'"),
        ("lognormal:median=abc,sigma=1", "median='abc'"),
        ("zipf:a=1.2,b=3", "unknown key"),
        ("lognormal:median=-5,sigma=1", "median"),
        ("fixed:n=0", ">= 1"),
        ("zipf:a=1,min=10,max=5", "max=5"),
        ("lognormal:median", "expected key=value"),
        ("empirical:column=prompt", "trace=FILE"),
    ],
)
def test_parse_length_dist_errors_name_the_text(text, match):
    with pytest.raises(ValueError, match=match):
        parse_length_dist(text)


def test_parse_empirical_from_trace(tmp_path):
    p = tmp_path / "v.csv"
    p.write_text("arrived_at,num_prefill_tokens,num_decode_tokens\n0,10,1\n1,20,2\n2,30,3\n")
    dist = parse_length_dist(f"empirical:trace={p},column=output")
    assert sorted(dist.values) == [1, 2, 3]


def test_parse_prefix_sharing():
    ps = parse_prefix_sharing(
        "num_prefixes=8,prefix_tokens=[lognormal:median=2048,sigma=0.5],a=1.2,fraction=0.5"
    )
    assert ps == PrefixSharing(
        num_prefixes=8, prefix_tokens=Lognormal(2048.0, 0.5), a=1.2, fraction=0.5
    )
    assert parse_prefix_sharing("prefix_tokens=1024").prefix_tokens == Fixed(1024)


@pytest.mark.parametrize("text", ["num_prefixes=0", "fraction=2", "colour=red", "a"])
def test_parse_prefix_sharing_errors(text):
    with pytest.raises(ValueError):
        parse_prefix_sharing(text)


# -- the generator holds the readers' limits (issue 29): what it writes, every reader reads


@pytest.mark.parametrize(
    "text, match",
    [
        ("fixed:1e10", "more than 2,147,483,647 tokens"),
        ("fixed:1e400", "not a finite number"),
        ("lognormal:median=1e300,sigma=1", "median=1e\\+300 is more than"),
        ("lognormal:median=1000,sigma=1,max=100000000000000", "max=100000000000000 is more than"),
        ("zipf:a=1.2,min=3000000000,max=3000000001", "min=3000000000 is more than"),
    ],
)
def test_length_specs_refuse_counts_no_reader_would_read(text, match):
    with pytest.raises(ValueError, match=match):
        parse_length_dist(text)


def test_lognormal_without_max_is_clipped_to_max_tokens():
    """A huge sigma overflows to inf: it used to wrap to -2**63 in int64 and be written as a
    negative count."""
    from traces.requests import MAX_TOKENS

    x = Lognormal(1000, 300.0).sample(np.random.default_rng(0), 1000)
    assert x.min() >= 1 and x.max() == MAX_TOKENS


def test_a_trace_at_the_limits_reads_back(tmp_path):
    from traces.requests import MAX_TOKENS

    tr = synth_requests(
        num_requests=3, rate_rps=1.0, prompt=Fixed(MAX_TOKENS), output=Fixed(MAX_TOKENS), seed=0
    )
    back = read_request_trace(write_request_trace(tr, tmp_path / "t.csv"))
    assert back.requests["prompt_tokens"].tolist() == [MAX_TOKENS] * 3


@pytest.mark.parametrize(
    "text, match",
    [
        ("prefix_tokens=[fixed:1e12]", "n=1000000000000 is more than"),
        ("block_tokens=10000000000000", "block_tokens=10000000000000 is more than"),
        ("num_prefixes=1000000000000", "more than 10,000,000 prefixes"),
        ("prefix_tokens=[[[[1]]]]", "nested '\\[' at character 16"),
        ("prefix_tokens=[1]]", "unbalanced ']'"),
        ("prefix_tokens=[[1]", "nested"),
        ("a=1," * 400, "characters long; at most 1,000"),
    ],
    ids=[
        "prefix-1e12-tokens",
        "block-1e13-tokens",
        "1e12-prefixes",
        "nested",
        "unbalanced-close",
        "unbalanced-open",
        "1600-characters",
    ],
)
def test_prefix_sharing_specs_are_bounded(text, match):
    with pytest.raises(ValueError, match=match):
        parse_prefix_sharing(text)


@pytest.mark.parametrize(
    "kw, match",
    [
        (
            dict(num_requests=3, rate_rps=1e-300),
            "would last about 2e\\+300 s, longer than 1e\\+11 s",
        ),
        (dict(duration_s=1e12, rate_rps=1e-10), "longer than 1e\\+11 s"),
        (
            dict(num_requests=3, rate_rps=1.0, arrival="gamma", cv=1e-300),
            "cv=1e-300 must be between",
        ),
        (
            dict(num_requests=3, rate_rps=1.0, arrival="gamma", cv=1e300),
            "cv=1e\\+300 must be between",
        ),
    ],
)
def test_arrivals_no_reader_would_read_are_refused(kw, match):
    with pytest.raises(ValueError, match=match):
        synth_requests(**kw)


def test_length_spec_length_is_bounded():
    with pytest.raises(ValueError, match="5,006 characters long"):
        parse_length_dist("fixed:" + "9" * 5000)
