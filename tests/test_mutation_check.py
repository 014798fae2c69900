"""tools/mutation_check.py itself: the list is well-formed and in sync with the code, and the outcomes are right
(a mutation the tests catch is killed, one they miss survives, a stale snippet is an error)."""

from __future__ import annotations

import importlib.util
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _tool():
    spec = importlib.util.spec_from_file_location("mutation_check", REPO / "tools" / "mutation_check.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses resolve their module by name
    spec.loader.exec_module(mod)
    return mod


mc = _tool()


def test_the_project_list_applies_and_covers_every_area():
    muts = mc.load(mc.DEFAULT_LIST)
    assert len(muts) >= 25
    assert [m.name for m in muts if mc.static_problem(m, REPO)] == []  # every snippet found exactly once
    areas = {m.name.split(".")[0] for m in muts}
    from vllm_omni_ascend_opt import registry

    assert {"flags", "plugin", "ablation", "fake", *registry.names()} <= areas


def _toy_repo(tmp_path: Path) -> Path:
    root = tmp_path / "toy"
    (root / "pkg").mkdir(parents=True)
    (root / "tests").mkdir()
    (root / "pkg" / "__init__.py").write_text(
        "def add(a, b):\n    return a + b\n\n\ndef mul(a, b):\n    return a * b\n"
    )
    (root / "tests" / "test_add.py").write_text("from pkg import add\n\n\ndef test_add():\n    assert add(2, 3) == 5\n")
    return root


def _entry(name: str, original: str, replacement: str) -> str:
    return textwrap.dedent(
        f"""
        [[mutation]]
        name = "{name}"
        file = "pkg/__init__.py"
        original = '''{original}'''
        replacement = '''{replacement}'''
        tests = ["tests/test_add.py"]
        why = "toy"
        """
    )


def test_outcomes_killed_survived_and_stale(tmp_path, capsys):
    root = _toy_repo(tmp_path)
    lst = tmp_path / "m.toml"
    lst.write_text(
        _entry("toy.add_subtracts", "return a + b", "return a - b")  # test_add catches it
        + _entry("toy.mul_adds", "return a * b", "return a + b")  # nothing tests mul
        + _entry("toy.stale", "return a / b", "return b / a")  # not in the file any more
    )
    rc = mc.main(["--list-file", str(lst), "--root", str(root), "-j", "2"])
    out = capsys.readouterr().out
    assert rc == 1
    assert "killed   toy.add_subtracts" in out and "SURVIVED toy.mul_adds" in out
    assert "ERROR    toy.stale" in out and "found 0 times" in out
    assert "1 of 3 killed, 1 survived, 1 errors" in out
    assert (root / "pkg" / "__init__.py").read_text().count("return a + b") == 1  # the tree itself is untouched
    assert mc.main(["--list-file", str(lst), "--root", str(root), "-k", "add_subtracts"]) == 0
