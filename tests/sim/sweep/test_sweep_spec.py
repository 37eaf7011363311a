"""SWEEP.yaml: grid expansion, paths, defaults, and errors that name file, line and key."""

import textwrap

import pytest

import policies
from sim.sweep import SweepSpecError, parse_sweep
from traces import bundled_path, generate_alloc_trace, write_alloc_trace


@pytest.fixture
def folder(tmp_path):
    """A sweep folder with two small allocation traces and a request trace."""
    write_alloc_trace(
        generate_alloc_trace(num_layers=2, num_requests=4, seed=1), tmp_path / "a.csv"
    )
    write_alloc_trace(
        generate_alloc_trace(num_layers=2, num_requests=4, seed=2), tmp_path / "b.csv"
    )
    (tmp_path / "requests.csv").write_bytes(bundled_path("azure_code_slice.csv").read_bytes())
    return tmp_path


def parse(folder, text):
    path = folder / "sweep.yaml"
    path.write_text(textwrap.dedent(text))
    return parse_sweep(path.read_text(), path)


def error(folder, text) -> SweepSpecError:
    with pytest.raises(SweepSpecError) as exc:
        parse(folder, text)
    return exc.value


def test_params_lists_expand_to_their_product_with_traces_and_capacities(folder):
    spec = parse(
        folder,
        """
        traces: [a.csv, b.csv]
        policies:
          - {policy: elastic, params: {high: [0.8, 0.9], patience: [4, 8, 16]}}
        capacities: [null, 1GiB]
    """,
    )
    assert len(spec.cells) == 2 * 6 * 2
    assert {c.policy for c in spec.cells} == {
        f"elastic:high={h},patience={p}" for h in (0.8, 0.9) for p in (4, 8, 16)
    }
    assert {c.capacity_bytes for c in spec.cells} == {None, 1 << 30}
    assert [c.trace_name for c in spec.cells[:12]] == ["a"] * 12  # traces outermost


def test_a_scalar_param_is_fixed_and_merges_with_the_spec_string(folder):
    spec = parse(
        folder,
        """
        traces: a.csv
        policies: [{policy: "size-class:min_class_bytes=1KiB", params: {classes_per_doubling: [2, 8]}}]
    """,  # noqa: E501
    )
    assert [c.policy for c in spec.cells] == [
        "size-class:min_class_bytes=1024,classes_per_doubling=2",
        "size-class:min_class_bytes=1024,classes_per_doubling=8",
    ]


def test_nested_policy_specs_sweep_as_strings(folder):
    spec = parse(
        folder,
        """
        traces: [a.csv]
        policies:
          - {policy: elastic, params: {base: [best-fit, "size-class:classes_per_doubling=8"]}}
    """,
    )
    assert [c.policy for c in spec.cells] == [
        "elastic:base=best-fit",
        "elastic:base=[size-class:classes_per_doubling=8]",
    ]
    for cell in spec.cells:
        policies.create(cell.policy)


def test_spec_strings_are_canonical_so_spellings_share_a_cell(folder):
    spec = parse(
        folder,
        """
        traces: [a.csv]
        policies: ["paged:page_bytes=2MiB", "paged:page_bytes=2097152", {policy: paged, params: {page_bytes: 2MiB}}]
    """,  # noqa: E501
    )
    assert [c.policy for c in spec.cells] == ["paged:page_bytes=2097152"]
    assert spec.num_duplicates == 2


def test_trace_paths_are_relative_to_the_file_and_bundled_names_work(folder):
    sub = folder / "sub"
    sub.mkdir()
    path = sub / "sweep.yaml"
    path.write_text(
        "traces: [../a.csv, 'bundled:llama1b_generate_slice.pickle.gz']\npolicies: [first-fit]\n"
    )
    spec = parse_sweep(path.read_text(), path)
    assert [c.trace.path for c in spec.cells] == [
        str((folder / "a.csv").resolve()),
        str(bundled_path("llama1b_generate_slice.pickle.gz").resolve()),
    ]
    assert [c.trace_name for c in spec.cells] == ["a", "llama1b_generate_slice"]
    assert [c.trace_format for c in spec.cells] == ["csv", "pytorch-snapshot"]


def test_a_trace_entry_can_name_itself(folder):
    spec = parse(folder, "traces: [{path: a.csv, name: prod}]\npolicies: [first-fit]\n")
    assert spec.cells[0].trace_name == "prod"


def test_simulate_grid_crosses_models_gpus_rates_and_options(folder):
    spec = parse(
        folder,
        """
        mode: simulate
        traces: [requests.csv]
        policies: [paged, best-fit]
        models: [llama-3.2-1b]
        gpus: [H200]
        rate_scales: [1, 2, 4]
        options: {kv_strategy: [pow2, grow], max_num_seqs: 64}
        capacities: [null, 4GiB]
    """,
    )
    assert len(spec.cells) == 2 * 3 * 2 * 2
    cell = spec.cells[0]
    assert (cell.mode, cell.model, cell.gpu, cell.trace_format) == (
        "simulate",
        "Llama-3.2-1B",
        "H200",
        "azure",
    )
    assert {c.options for c in spec.cells} == {
        (("kv_strategy", s), ("max_num_seqs", 64)) for s in ("pow2", "grow")
    }
    assert {c.rate_scale for c in spec.cells} == {1.0, 2.0, 4.0}
    assert spec.pareto_by == ["trace", "cell_model", "cell_gpu", "cell_rate_scale"]


def test_simulate_options_are_read_by_the_config_knobs_units(folder):
    spec = parse(
        folder,
        """
        mode: simulate
        traces: [requests.csv]
        policies: [paged]
        options: {swap_space_bytes: [1GiB, null], workspace_bytes: 256MiB, horizon_s: 30}
    """,
    )
    assert {c.options for c in spec.cells} == {
        (("horizon_s", 30), ("swap_space_bytes", s), ("workspace_bytes", 256 << 20))
        for s in (1 << 30, None)
    }


def test_defaults(folder):
    spec = parse(folder, "traces: a.csv\npolicies: first-fit\n")
    assert (spec.mode, spec.name, len(spec.cells), spec.cells[0].capacity_bytes) == (
        "replay",
        "sweep",
        1,
        None,
    )
    assert (spec.pareto_x, spec.pareto_y) == ("overhead", ["alloc_p99_us", "failure_rate"])


@pytest.mark.parametrize(
    "text, line, needle",
    [
        ("traces: [a.csv\npolicies: [first-fit]\n", 2, "not valid YAML"),
        ("traces: [a.csv]\npolicies: [first-fit]\ncapacity: 1GiB\n", 3, "capacity: unknown key"),
        (
            "traces: [a.csv]\npolicies:\n  - first-fit\n  - no-such-policy\n",
            4,
            "policies[1]: policy spec 'no-such-policy': unknown policy 'no-such-policy'",
        ),
        (
            "traces: [a.csv]\npolicies:\n  - {policy: paged, params: {pages: [1, 2]}}\n",
            3,
            "has no parameter 'pages'",
        ),
        (
            "traces: [a.csv]\npolicies:\n  - policy: size-class\n    params:\n"
            "      classes_per_doubling: []\n",
            5,
            "policies[0].params.classes_per_doubling: an empty list sweeps nothing",
        ),
        ("traces: [a.csv, missing.csv]\npolicies: [first-fit]\n", 1, "traces[1]: no such file"),
        (
            "traces: [a.csv]\npolicies: [first-fit]\nrate_scales: [2]\n",
            3,
            "rate_scales: only for mode: simulate",
        ),
        (
            "traces: [a.csv]\npolicies: [first-fit]\ntraces: [b.csv]\n",
            3,
            "traces: given twice (first on line 1)",
        ),
        (
            "traces: [a.csv]\npolicies: [first-fit]\ncapacities: [1GiB, lots]\n",
            3,
            "capacities[1]: cannot read 'lots'",
        ),
        (
            "traces: [a.csv]\npolicies: [first-fit]\npareto: {y: latency}\n",
            3,
            "pareto.y: 'latency' is not a report column",
        ),
        (
            "traces: [requests.csv]\npolicies: [first-fit]\n",
            1,
            "traces[0]: not an allocation trace",
        ),
        (
            "traces: [a.csv, {path: a.csv}]\npolicies: [first-fit]\n",
            1,
            "trace name 'a' is also traces[0]'s",
        ),
        (
            "mode: simulate\ntraces: [requests.csv]\npolicies: [paged]\noptions: {kv_strategy: "
            "[pow2, best]}\n",
            4,
            "kv_strategy(='best') must be one of",
        ),
        (
            "mode: simulate\ntraces: [requests.csv]\npolicies: [paged]\nmodels: [GPT-9]\n",
            4,
            "models[0]: unknown model",
        ),
        (
            "mode: replay-ish\ntraces: [a.csv]\npolicies: [first-fit]\n",
            1,
            "mode: 'replay-ish' is not a mode",
        ),
        ("traces: [a.csv]\n", None, "missing key 'policies'"),
    ],
)
def test_errors_name_file_line_and_key(folder, text, line, needle):
    err = error(folder, text)
    assert err.line == line
    assert needle in str(err)
    assert str(err).startswith(str(folder / "sweep.yaml") + (f", line {line}:" if line else ":"))


def test_an_error_is_a_value_error_for_the_command_line(folder):
    assert isinstance(error(folder, "[]"), ValueError)


# -- hostile files (issue 29): bounded before they are built, one error naming file, line and limit


def _laughs(levels: int) -> str:
    """Ten aliases of ten, ``levels`` deep: ``capacities`` stands for 10**levels values."""
    lines = ["a0: &a0 [1MiB, 1MiB, 1MiB, 1MiB, 1MiB, 1MiB, 1MiB, 1MiB, 1MiB, 1MiB]"]
    lines += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]" for i in range(1, levels + 1)]
    return "\n".join(lines)


def test_a_billion_laughs_is_refused_without_being_expanded(folder):
    """It used to hang: PyYAML's constructor shares aliased lists, but the key index walked them
    all."""
    from sim.sweep.spec import MAX_YAML_NODES

    err = error(
        folder, "traces: [a.csv]\npolicies: [first-fit]\n" + _laughs(9) + "\ncapacities: *a9\n"
    )
    assert (
        err.line == 7 and f"more than {MAX_YAML_NODES:,}" in err.reason
    )  # a4: the first to hold too many
    assert "the whole file: 23,456,790,139" in err.reason


def test_aliases_within_the_limit_still_work(folder):
    spec = parse(
        folder, "traces: [a.csv]\npolicies: &p [first-fit, best-fit]\ncapacities: [1GiB]\n"
    )
    assert len(spec.cells) == 2


def test_an_alias_inside_itself_is_refused(folder):
    err = error(folder, "traces: [a.csv]\npolicies: &p [first-fit, *p]\n")
    assert err.line == 2 and "contains it" in err.reason


@pytest.mark.parametrize(
    "deep", ["[" * 5000 + "]" * 5000, "{a: " * 3000 + "1" + "}" * 3000], ids=["lists", "mappings"]
)
def test_deep_nesting_is_refused_while_composing(folder, deep):
    """It used to raise RecursionError (PyYAML composes recursively)."""
    from sim.sweep.spec import MAX_YAML_DEPTH

    err = error(folder, f"traces: [a.csv]\npolicies: [first-fit]\nname: {deep}\n")
    assert err.line == 3 and f"nested more than {MAX_YAML_DEPTH} levels deep" in err.reason


def test_deep_nesting_through_aliases_is_refused(folder):
    chain = "\n".join(["x0: &x0 [1]"] + [f"x{i}: &x{i} [*x{i - 1}]" for i in range(1, 60)])
    err = error(folder, "traces: [a.csv]\npolicies: [first-fit]\n" + chain + "\nname: *x59\n")
    assert "with its aliases expanded the file nests 62 levels deep" in err.reason


def test_a_grid_of_a_billion_cells_is_refused_before_it_is_built(folder):
    """It used to run out of memory after 19 s building the product."""
    values = ", ".join(str(i) for i in range(1, 1001))
    caps = ", ".join(f"{i}MiB" for i in range(1, 1001))
    err = error(
        folder,
        f"""
        mode: simulate
        traces: [requests.csv]
        policies: [{{policy: paged, params: {{page_tokens: [{values}]}}}}]
        capacities: [{caps}]
        rate_scales: [{values}]
    """,
    )
    assert err.line is None and err.path.endswith("sweep.yaml")
    assert "the grid has 1,000,000,000 cells, more than 100,000" in err.reason


def test_the_cell_count_before_duplicates_is_what_the_grid_builds(folder):
    from sim.sweep.spec import _num_cells

    spec = parse(
        folder,
        """
        traces: [a.csv, b.csv]
        policies:
          - first-fit
          - {policy: elastic, params: {high: [0.8, 0.9], patience: [4, 8, 16]}}
        capacities: [null, 1GiB]
    """,
    )
    assert len(spec.cells) + spec.num_duplicates == 2 * (1 + 6) * 2
    assert (
        _num_cells(
            {
                "traces": ["a", "b"],
                "policies": [
                    "first-fit",
                    {"policy": "elastic", "params": {"high": [0.8, 0.9], "patience": [4, 8, 16]}},
                ],
                "capacities": [None, 1],
            },
            "replay",
        )
        == 28
    )
