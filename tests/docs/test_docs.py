# SPDX-License-Identifier: Apache-2.0
"""The documentation's own checks: generated figures match the committed benchmark JSON, and every
relative link in README.md and docs/ reaches a file (and heading) that exists."""

from __future__ import annotations

import pathlib
import re

import pytest

from tests.benchmark_scripts import load_benchmark

REPO = pathlib.Path(__file__).resolve().parents[2]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)
CODE_SPAN = re.compile(r"`[^`\n]*`")


def github_anchors(markdown: str) -> set[str]:
    """The anchors GitHub gives the headings of `markdown` (repeats get -1, -2, ...)."""
    anchors: set[str] = set()
    for line in FENCE.sub("", markdown).splitlines():
        match = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not match:
            continue
        base = re.sub(r"[^\w\- ]", "", match.group(1).lower()).replace(" ", "-")
        anchor, n = base, 0
        while anchor in anchors:
            n += 1
            anchor = f"{base}-{n}"
        anchors.add(anchor)
    return anchors


def relative_links(markdown: str) -> list[str]:
    """Link targets outside code blocks and code spans that are not URLs."""
    text = CODE_SPAN.sub("", FENCE.sub("", markdown))
    return [t for t in LINK.findall(text) if not re.match(r"^[a-z][a-z0-9+.-]*:", t)]


def test_anchor_rules_on_hand_worked_headings():
    text = (
        "# Performance\n## What fits where: the planner\n## `VLLM_XLA_PLATFORM`\n## A\n## A\n```\n# not\n```"
    )
    assert github_anchors(text) == {
        "performance",
        "what-fits-where-the-planner",
        "vllm_xla_platform",
        "a",
        "a-1",
    }
    assert relative_links("[a](docs/x.md#y) [b](https://x.org) `[c](no.md)` ![d](img.png)") == [
        "docs/x.md#y",
        "img.png",
    ]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_reach_files_and_headings(page: pathlib.Path):
    broken = []
    for target in relative_links(page.read_text()):
        path_part, _, anchor = target.partition("#")
        path = (page.parent / path_part).resolve() if path_part else page
        if not path.exists():
            broken.append(f"{target}: no file {path}")
        elif anchor and path.suffix == ".md" and anchor not in github_anchors(path.read_text()):
            broken.append(f"{target}: no heading with anchor #{anchor} in {path.name}")
    assert not broken, f"{page.relative_to(REPO)}:\n" + "\n".join(broken)


def test_readme_and_performance_page_match_the_committed_benchmark_json():
    """Both are rendered by benchmarks/render_docs.py; rerun it after changing the JSON or the script."""
    for path, text in load_benchmark("render_docs").render().items():
        assert path.read_text() == text, f"{path.relative_to(REPO)} is stale: run benchmarks/render_docs.py"


def test_every_committed_result_names_its_machine_and_run():
    results = load_benchmark("render_docs").load_runs()
    assert results, "no benchmarks/results/throughput-<machine kind>.json committed"
    for kind, report in results.items():
        assert report["machine"]["cpu_model"] and report["machine"]["nproc"], kind
        entries = [e for peers in report["results"].values() for e in peers.values()]
        assert any(e.get("status") == "ok" for e in entries), kind
