"""The upstream patches in ``patches/``: one per optimization, each with its header, each applying to a pristine
vLLM-Omni tree alone and stacked in order, and each computing what the plugin computes (bitwise-equal images
and identical kernel-launching op counts on the tiny pipeline; exact ones also equal to stock).

Two series (``check.SERIES``): ``patches/*.patch`` against 0.30.0 and ``patches/0.32/*.patch`` rebased on 0.32.0rc1.
Headers, numbering and paths are checked for both; applying and exactness for the series that targets the installed
vLLM-Omni (the 0.30 series in ``.venv``; ``make test-versions`` runs ``patches/check.py`` in the other venvs).

The checks are ``patches/check.py``'s functions (imported from the file): the exactness run costs one fresh process
per patch (the patched tree) plus ONE shared process for the plugin side, at most two at a time.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _load_check():
    spec = importlib.util.spec_from_file_location("patches_check", REPO / "patches" / "check.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses resolve their module by name
    spec.loader.exec_module(mod)
    return mod


check = _load_check()
#: The series that targets the installed vLLM-Omni (the 0.30 series on 0.30/0.31), applied and compared below.
SERIES = check.series_for_installed() or check.SERIES[0]
PATCHES = SERIES.patches()
ALL_PATCHES = [p for s in check.SERIES for p in s.patches()]


def _id(p: Path) -> str:
    return str(p.relative_to(check.HERE))


def _registry_names() -> list[str]:
    from vllm_omni_ascend_opt import registry

    return registry.names()


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("patches")


@pytest.fixture(scope="module")
def applied(workdir) -> dict[tuple[str, str], tuple[bool, str]]:
    return {(p.name, label): (ok, msg) for p, label, ok, msg in check.apply_checks(PATCHES, workdir)}


@pytest.fixture(scope="module")
def exactness(workdir, applied) -> dict[str, object]:
    applicable = [p for p in PATCHES if applied[(p.name, "alone")][0]]
    return {v.patch.name: v for v in check.check_exactness(applicable, workdir)}


@pytest.mark.parametrize("series", check.SERIES, ids=lambda s: s.name)
def test_one_patch_per_optimization_numbered_in_order(series):
    names = _registry_names()
    patches = series.patches()
    by_opt: dict[str, list[str]] = {}
    for p in patches:
        by_opt.setdefault(check.optimization_of(p), []).append(p.name)
    assert set(by_opt) <= set(names), f"patches for unknown optimizations: {sorted(set(by_opt) - set(names))}"
    assert all(len(v) == 1 for v in by_opt.values()), by_opt
    from vllm_omni_ascend_opt import registry

    exempt = [n for n in names if registry.get(n).no_patch_reason]  # each says why (the patches table shows it)
    assert not [n for n in exempt if n in by_opt], "an optimization with a patch must not declare no_patch_reason"
    missing = [n for n in names if n not in by_opt and n not in exempt]
    assert not missing, f"optimizations without a patch: {missing}"
    numbers = [int(check.PATCH_RE.match(p.name).group(1)) for p in patches]
    assert numbers == list(range(1, len(patches) + 1)), numbers
    assert [check.optimization_of(p) for p in patches] == [n for n in names if n in by_opt]  # registry order


def test_series_are_found_and_the_rebased_one_needs_base_and_overlap(tmp_path):
    assert [s.name for s in check.SERIES] == ["0.30", "0.32"]
    assert check.SERIES[0].covers("0.31.0rc1") and not check.SERIES[0].covers("0.32.0rc1")
    assert check.SERIES[1].covers("0.32.0rc1") and not check.SERIES[1].covers(None)
    assert check.series_of(check.SERIES[1].patches()[0]) is check.SERIES[1]
    assert check.series_of(check.SERIES[0].patches()[0]) is check.SERIES[0]
    rebased = check.SERIES[1]
    assert rebased.required_fields[-1] == "Removal plan"
    assert {"Base", "Upstream overlap"} <= set(rebased.required_fields)
    assert "Base" not in check.SERIES[0].required_fields
    with pytest.raises(ValueError, match="no patch series"):
        check.series_of(tmp_path / "0001-x.patch")


def test_header_field_parser_catches_missing_fields(tmp_path):
    p = tmp_path / "0001-x.patch"
    p.write_text("What: a\nWhy: b\n  continued\nHow:\ndiff --git a/x b/x\nRisks: after the diff line\n")
    assert check.header_fields(p)["Why"] == "b continued"
    assert check.missing_fields(p) == ["How", "Equivalence", "Measured effect", "Risks", "Removal plan"]
    q = tmp_path / "0002-y.patch"
    q.write_text("Enable: FOO_BAR=1 (opt-in) lower=2\ndiff --git a/x b/x\n")
    assert check.enable_env(q) == {"FOO_BAR": "1"}


@pytest.mark.parametrize("patch", ALL_PATCHES, ids=_id)
def test_header_has_every_field(patch):
    assert check.missing_fields(patch) == []
    fields = check.header_fields(patch)
    from vllm_omni_ascend_opt import registry

    equivalence = registry.get(check.optimization_of(patch)).equivalence
    assert fields["Equivalence"].lower().startswith(equivalence), (fields["Equivalence"][:60], equivalence)
    assert re.search(r"\bCPU\b|\bNPU\b", fields["Measured effect"]), "measured effect must name the machine"
    series = check.series_of(patch)
    if series is not check.SERIES[0]:  # a rebased patch names its base and its 0.30 twin, and the PRs it overlaps
        assert series.base in fields["Base"] and f"patches/{patch.name}" in fields["Base"], fields["Base"]
        assert re.search(r"#\d{3,5}|none|not found|no open PR", fields["Upstream overlap"]), fields["Upstream overlap"]


def test_the_rebased_series_changes_what_the_0_30_series_changes():
    """Same files touched and the same new modules, byte for byte where upstream did not move (the rebase only
    re-places hunks); a patch whose 0.30 twin still applies unchanged keeps its added lines."""
    for p in check.SERIES[1].patches():
        twin = check.HERE / p.name
        assert sorted(check.touched_files(p)) == sorted(check.touched_files(twin)), p.name
        added = {line for line in p.read_text().split("\ndiff --git", 1)[1].splitlines() if line.startswith("+")}
        added_30 = {line for line in twin.read_text().split("\ndiff --git", 1)[1].splitlines() if line.startswith("+")}
        # every line the 0.30 patch adds is added in the rebased one, except import lines upstream now has
        missing = {a for a in added_30 - added if not a.startswith("+++") and "import" not in a}
        allowed = {  # rebase edits, each explained in the patch's Base field: forward_cuda and its docstring
            "0001-shared_modulation.patch": {
                "AdaLayerNorm.forward_cuda",
                "(native, CUDA, HIP)",
                "(NPU without MindIE-SD);",
                "MindIE-SD's fused",
                "instance is called as usual",
            },
        }.get(p.name, set())
        missing = {m for m in missing if not any(a in m for a in allowed)}
        assert not missing, (p.name, sorted(missing)[:5])


@pytest.mark.parametrize("label", ["alone", "stacked"])
@pytest.mark.parametrize("patch", PATCHES, ids=_id)
def test_applies_to_the_pristine_installed_tree(applied, patch, label):
    ok, msg = applied[(patch.name, label)]
    assert ok, msg


def test_paths_are_upstream_package_paths():
    for p in ALL_PATCHES:
        heads = [line for line in p.read_text().splitlines() if line.startswith("diff --git")]
        assert heads, p.name
        for line in heads:
            assert re.fullmatch(r"diff --git a/vllm_omni/\S+ b/vllm_omni/\S+", line), (p.name, line)


@pytest.mark.parametrize("patch", PATCHES, ids=_id)
def test_patched_upstream_computes_what_the_plugin_computes(exactness, patch):
    v = exactness.get(patch.name)
    assert v is not None, "patch did not apply; see test_applies_to_the_pristine_installed_tree"
    if v.status == "skip":
        from vllm_omni_ascend_opt import _backend, registry

        opt = registry.get(check.optimization_of(patch))
        assert opt.equivalence != "exact", "an exact patch must be checked"
        # The only acceptable reason to leave a patch unchecked is that its kernels need an NPU this machine lacks;
        # any other reason (a fingerprint mismatch, a bad flag) is a regression, not a skip.
        npu_why = _backend.npu_unavailable_reasons()
        assert npu_why and opt.reasons_inactive() == npu_why, (opt.reasons_inactive(), npu_why)
        assert all(r in v.message for r in npu_why), v.message
        pytest.skip(v.message)
    assert v.status == "ok", v.message
