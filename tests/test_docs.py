"""Docs derived from the code (tools/gen_docs.py tables, patch headers, README example) say what the code says."""

from __future__ import annotations

import re

import pytest

from tests.harness import REPO, load_script
from vllm_omni_ascend_opt import registry


@pytest.fixture(scope="module")
def gen_docs():
    return load_script("gen_docs", "tools/gen_docs.py")


def test_generated_tables_match_the_registry_and_change_with_it(gen_docs, monkeypatch):
    assert gen_docs.out_of_date() == [], "run: python tools/gen_docs.py"
    opt = registry.get("rope")
    monkeypatch.setattr(type(opt), "summary", "something else entirely")
    assert set(gen_docs.out_of_date()) == {"README.md", "patches/README.md", "patches/0002-rope.patch"}


def test_patch_headers_say_what_the_class_says_and_keep_the_diff_for_every_optimization(gen_docs, monkeypatch):
    opt = registry.get("vae_exact")
    rel = "patches/0005-vae_exact.patch"
    before = (REPO / rel).read_text()
    monkeypatch.setattr(type(opt), "why", "a new reason, long enough to be wrapped " * 5)
    monkeypatch.setattr(type(opt), "upstream_pr", "")  # empty: the patch's own text stays
    after = gen_docs.patches()[rel]
    fields, diff = gen_docs.split_patch(after)
    assert diff == gen_docs.split_patch(before)[1] and after.startswith("0005-vae_exact\n\nWhat: ")
    assert " ".join(fields["Why"].split()) == "Why: " + " ".join(opt.why.split())
    assert max(len(line) for line in fields["Why"].splitlines()) <= 118
    assert fields["Upstream overlap"] == gen_docs.split_patch(before)[0]["Upstream overlap"]
    assert list(fields) == [f for f in gen_docs.PATCH_FIELDS if f in fields]  # the fixed order
    for i, opt in enumerate(registry.all_optimizations()):
        if opt.no_patch_reason:  # says why it has none (tests/test_patches.py: and that it has none)
            continue
        path = REPO / "patches" / gen_docs.patch_name(i, opt.name)
        head = path.read_text().split("\ndiff --git", 1)[0]
        (line,) = re.findall(r"^Equivalence: (\w+)", head, re.M)
        assert line == opt.equivalence, (path.name, line, opt.equivalence)


def test_the_readme_example_status_line_names_every_default_optimization():
    readme = (REPO / "README.md").read_text()
    (line,) = [ln for ln in readme.splitlines() if "vllm-omni-ascend-opt 0.1.0 (VLLM_OMNI_ASCEND_OPT=default)" in ln]
    installed = line.split("installed ", 1)[1].split(";", 1)[0].split(", ")
    off = dict(re.findall(r"(\w+) \(([^)]*)\)", line.split("; off: ", 1)[1]))
    names = registry.names()
    assert installed == registry.default_names() and list(off) == [n for n in names if n not in installed]
    assert all(why == "not selected by VLLM_OMNI_ASCEND_OPT" for why in off.values())
