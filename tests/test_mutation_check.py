"""tools/mutation_check.py itself: the list is well-formed and in sync with the code, and the outcomes are right
(a mutation the tests catch is killed, one they miss survives, a stale snippet is an error)."""

from __future__ import annotations

import textwrap
import time
from pathlib import Path

import pytest

from tests.harness import REPO, load_script

mc = load_script("mutation_check", "tools/mutation_check.py")


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


@pytest.fixture
def light_zygote(monkeypatch):
    """Zygotes that preload only pytest (the toy repository needs nothing else)."""
    monkeypatch.setenv("MUTATION_ZYGOTE_PRELOAD", "pytest")


@pytest.mark.parametrize("spawn", ["zygote", "interpreter"])
def test_outcomes_killed_survived_and_stale(tmp_path, capsys, light_zygote, spawn):
    root = _toy_repo(tmp_path)
    lst = tmp_path / "m.toml"
    lst.write_text(
        _entry("toy.add_subtracts", "return a + b", "return a - b")  # test_add catches it
        + _entry("toy.mul_adds", "return a * b", "return a + b")  # nothing tests mul
        + _entry("toy.stale", "return a / b", "return b / a")  # not in the file any more
    )
    how = [] if spawn == "zygote" else ["--no-zygote"]
    rc = mc.main(["--list-file", str(lst), "--root", str(root), "-j", "2", *how])
    out = capsys.readouterr().out
    assert rc == 1
    assert "killed   toy.add_subtracts" in out and "SURVIVED toy.mul_adds" in out
    assert "ERROR    toy.stale" in out and "found 0 times" in out
    assert "1 of 3 killed, 1 survived, 1 errors" in out
    assert (root / "pkg" / "__init__.py").read_text().count("return a + b") == 1  # the tree itself is untouched
    assert mc.main(["--list-file", str(lst), "--root", str(root), "-k", "add_subtracts", *how]) == 0


def test_zygote_kills_a_hanging_mutant_with_its_process_group(tmp_path, capsys, light_zygote, monkeypatch):
    """A hanging forked mutant dies with its group (an ERROR); the next one imports its own scratch tree."""
    root = _toy_repo(tmp_path)
    (root / "tests" / "test_add.py").write_text(
        "import os, subprocess, sys\nfrom pkg import add\n\n\ndef test_add():\n"
        "    p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        "    with open(os.environ['TOY_PIDS'], 'a') as f:\n"
        "        f.write(f'{p.pid}\\n')\n"
        "    assert add(2, 3) == 5\n"
    )
    pids = tmp_path / "pids"
    monkeypatch.setenv("TOY_PIDS", str(pids))
    lst = tmp_path / "m.toml"
    lst.write_text(
        _entry("toy.hangs", "return a + b", "while True: pass")
        + "timeout = 3\n"
        + _entry("toy.add_subtracts", "return a + b", "return a - b")
    )
    rc = mc.main(["--list-file", str(lst), "--root", str(root), "-j", "1"])
    out = capsys.readouterr().out
    assert rc == 1, out
    assert "ERROR    toy.hangs" in out and "timed out after 3 s" in out
    assert "killed   toy.add_subtracts" in out
    hung = int(pids.read_text().split()[0])  # the hanging mutant's own child
    for _ in range(50):
        stat = Path(f"/proc/{hung}/stat")
        if not stat.exists() or stat.read_text().rsplit(")", 1)[-1].split()[0] == "Z":
            return
        time.sleep(0.1)
    raise AssertionError(f"process {hung} of the timed-out mutant is still running")
