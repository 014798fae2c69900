"""``patches/`` (one patch per optimization, in registry order, with headers) and ``patches/check.py``'s gate and
apply machinery; applying the series for real needs ``check.BASE``'s tree (``make test-versions``)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.harness import load_script
from vllm_omni_ascend_opt import registry

check = load_script("patches_check", "patches/check.py")
PATCHES = check.patch_files()


def test_one_series_in_patches_one_patch_per_optimization_numbered_in_order():
    assert not [p for p in check.HERE.rglob("*.patch") if p.parent != check.HERE], "patches outside patches/"
    assert len(PATCHES) == len(list(check.HERE.glob("*.patch"))), "a .patch file not named 000N-<optimization>"
    names = registry.names()
    by_opt: dict[str, list[str]] = {}
    for p in PATCHES:
        by_opt.setdefault(check.optimization_of(p), []).append(p.name)
    assert set(by_opt) <= set(names), f"patches for unknown optimizations: {sorted(set(by_opt) - set(names))}"
    assert all(len(v) == 1 for v in by_opt.values()), by_opt
    exempt = [n for n in names if registry.get(n).no_patch_reason]  # each says why (the patches table shows it)
    assert not [n for n in exempt if n in by_opt], "an optimization with a patch must not declare no_patch_reason"
    missing = [n for n in names if n not in by_opt and n not in exempt]
    assert not missing, f"optimizations without a patch: {missing}"
    numbers = [int(check.PATCH_RE.match(p.name).group(1)) for p in PATCHES]
    assert numbers == list(range(1, len(PATCHES) + 1)), numbers
    assert [check.optimization_of(p) for p in PATCHES] == [n for n in names if n in by_opt]  # registry order


def test_the_series_is_applied_on_its_release_only():
    assert check.BASE == "0.32.0rc1" and all(map(check.applies_to, [check.BASE, "0.32.0", "0.32.1"]))
    assert not any(map(check.applies_to, ["0.30.0", "0.31.0rc1", None, "0.3.2", "1.32.0"]))


def test_header_field_parser_catches_missing_fields(tmp_path):
    p = tmp_path / "0001-x.patch"
    p.write_text("What: a\nWhy: b\n  continued\nHow:\ndiff --git a/x b/x\nRisks: after the diff line\n")
    assert check.header_fields(p)["Why"] == "b continued"
    assert check.header_problems(p) == [
        f"missing {f}"
        for f in ("How", "Equivalence", "Measured effect", "Risks", "Base", "Upstream overlap", "Removal plan")
    ]
    q = tmp_path / "0002-y.patch"
    q.write_text("Enable: FOO_BAR=1 (opt-in) lower=2\ndiff --git a/x b/x\n")
    assert check.enable_env(q) == {"FOO_BAR": "1"}
    r = tmp_path / "0003-z.patch"
    r.write_text("".join(f"{f}: x\n" for f in check.REQUIRED_FIELDS) + "diff --git a/x b/x\n")
    assert check.header_problems(r) == [f"Base does not name {check.BASE}"]
    r.write_text(r.read_text().replace("Base: x", f"Base: vLLM-Omni {check.BASE}"))
    assert check.header_problems(r) == []


@pytest.mark.parametrize("patch", PATCHES, ids=lambda p: p.name)
def test_header_has_every_field_and_the_paths_are_upstream_package_paths(patch):
    assert check.header_problems(patch) == []
    fields = check.header_fields(patch)
    equivalence = registry.get(check.optimization_of(patch)).equivalence
    assert fields["Equivalence"].lower().startswith(equivalence), (fields["Equivalence"][:60], equivalence)
    assert re.search(r"\bCPU\b|\bNPU\b", fields["Measured effect"]), "measured effect must name the machine"
    assert re.search(r"#\d{3,5}|none|not found|no open PR", fields["Upstream overlap"]), fields["Upstream overlap"]
    assert "twin" not in fields["Base"] and "patches/" not in fields["Base"], "Base names another series"
    heads = [line for line in patch.read_text().splitlines() if line.startswith("diff --git")]
    assert heads and all(re.fullmatch(r"diff --git a/vllm_omni/\S+ b/vllm_omni/\S+", ln) for ln in heads), heads


def _main(monkeypatch, capsys, version: str, argv: list[str], patches: list[Path] = PATCHES):
    """check.main on ``patches`` with vLLM-Omni ``version`` installed; the apply and exactness runs are recorded."""
    calls: list[str] = []

    def apply_checks(ps, work):
        calls.append("apply")
        return [(p, label, True, "applies") for p in ps for label in ("alone", "stacked")]

    def check_exactness(ps, work, parallel=2):
        calls.append("exactness")
        return [check.Verdict(ps[0], "FAIL", "differs"), *(check.Verdict(p, "ok", "equal") for p in ps[1:])]

    monkeypatch.setattr(check, "installed_version", lambda: version)
    monkeypatch.setattr(check, "patch_files", lambda: patches)
    monkeypatch.setattr(check, "apply_checks", apply_checks)
    monkeypatch.setattr(check, "check_exactness", check_exactness)
    rc = check.main(argv)
    return rc, calls, capsys.readouterr().out


@pytest.mark.parametrize("version", ["0.30.0", "0.31.0rc1", None])
def test_check_skips_applying_on_other_releases_and_says_so(monkeypatch, capsys, version):
    rc, calls, out = _main(monkeypatch, capsys, version, ["--exactness"])
    assert rc == 0 and calls == []
    assert f"the series targets vLLM-Omni {check.BASE}: apply and exactness checks skipped" in out, out
    (summary,) = [ln for ln in out.splitlines() if ln.startswith("summary:")]
    assert f"headers {len(PATCHES)} ok, 0 FAIL; not applied" in summary, summary


@pytest.mark.parametrize("version", ["0.30.0", "0.32.0rc1"])
def test_check_fails_on_a_bad_header_on_any_release(monkeypatch, capsys, tmp_path, version):
    bad = tmp_path / "0001-shared_modulation.patch"
    bad.write_text("What: a\ndiff --git a/vllm_omni/x b/vllm_omni/x\n")
    rc, calls, out = _main(monkeypatch, capsys, version, [], [bad, *PATCHES[1:]])
    assert rc == 1 and "FAIL 0001-shared_modulation.patch header: missing Why" in out, out
    assert calls == ([] if version == "0.30.0" else ["apply"])


def test_check_applies_and_compares_on_its_release(monkeypatch, capsys):
    rc, calls, out = _main(monkeypatch, capsys, check.BASE, [])
    assert rc == 0 and calls == ["apply"]
    assert f"apply {2 * len(PATCHES)} ok, 0 FAIL" in out.splitlines()[-1], out
    rc, calls, out = _main(monkeypatch, capsys, "0.32.0", ["--exactness"])
    assert rc == 1 and calls == ["apply", "exactness"], "an exactness FAIL fails the check"
    assert out.splitlines()[-1].endswith(f"vs plugin: FAIL 0001, ok {' '.join(p.name[:4] for p in PATCHES[1:])}"), out


def test_apply_checks_report_what_does_not_apply_or_compile(tmp_path):
    """A new module applies, a syntax error does not compile, a stale hunk does not apply (pristine tree)."""

    def new_file(name: str, line: str) -> str:
        return (
            f"diff --git a/vllm_omni/{name} b/vllm_omni/{name}\nnew file mode 100644\n--- /dev/null\n"
            f"+++ b/vllm_omni/{name}\n@@ -0,0 +1 @@\n+{line}\n"
        )

    good, broken, stale = tmp_path / "0001-good.patch", tmp_path / "0002-broken.patch", tmp_path / "0003-stale.patch"
    good.write_text(new_file("_probe_good.py", "X = 1"))
    broken.write_text(new_file("_probe_broken.py", "def f(:"))
    stale.write_text(
        "diff --git a/vllm_omni/__init__.py b/vllm_omni/__init__.py\n--- a/vllm_omni/__init__.py\n"
        "+++ b/vllm_omni/__init__.py\n@@ -1,1 +1,1 @@\n-this line is not in vllm_omni/__init__.py\n+x = 1\n"
    )
    work = tmp_path / "work"
    work.mkdir()
    got = {(p.name[:4], label): (ok, msg) for p, label, ok, msg in check.apply_checks([good, broken, stale], work)}
    for label in ("alone", "stacked"):
        assert got[("0001", label)] == (True, "applies, touched Python files compile")
        ok, msg = got[("0002", label)]
        assert not ok and msg.startswith("applies but does not compile: vllm_omni/_probe_broken.py"), msg
        ok, msg = got[("0003", label)]
        assert not ok and msg.startswith("check: "), msg
    assert (work / "stack" / "vllm_omni" / "_probe_good.py").read_text() == "X = 1\n"
