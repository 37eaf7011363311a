"""The README stays a landing page: two screens, the two set-up commands as they are, links that
resolve (mkdocs checks the docs' own links; the README is outside the site)."""

import re

from docs_sessions import ROOT

README = (ROOT / "README.md").read_text()


def test_the_readme_fits_on_two_screens():
    assert len(README.splitlines()) <= 155


def test_the_set_up_commands_are_there_as_they_are():
    assert "```\npip install -e . && poollab demo\n```" in README
    assert '```\npip install -e ".[dev]" && pytest\n```' in README
    ci = (ROOT / ".ci" / "run").read_text().rstrip("\n").splitlines()
    assert (
        ci[-1] == 'pip install -e ".[dev]" && pytest'
    )  # .ci/run ends with the README's test command


def test_the_four_workflows_are_there():
    headings = re.findall(r"^## (.+)$", README, re.M)
    for workflow in ("Replay", "Simulate", "Validate on a GPU", "Compare and sweep"):
        assert any(workflow in h for h in headings), workflow


def test_every_relative_link_of_the_readme_resolves():
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", README)
    local = [link for link in links if "://" not in link]
    assert local, "the README links into the docs"
    missing = [link for link in local if not (ROOT / link).exists()]
    assert missing == []
