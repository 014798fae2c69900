#!/usr/bin/env python3
"""Mutation check: deliberate, named bugs that the test suite must catch.

Each mutation in ``tools/mutations.toml`` replaces one snippet of the project with a broken variant (a semantic
bug: a cache key missing a component, a fallback that never fires, a gate that is too lax, ...). For each mutation
this script copies the repository into a scratch directory, applies the replacement there, and runs the pytest
selection the mutation names, with ``PYTHONPATH`` pointing at the scratch copy (the checkout is never modified).

* ``killed``   -- the selection failed (what we want: the tests notice the bug);
* ``SURVIVED`` -- the selection passed: a test is missing or too weak. The check fails and names it;
* ``ERROR``    -- the original snippet is not found exactly once (the list is out of date with the code), the file
  does not exist, the selection collected no tests, or it timed out (inconclusive). The check fails.

Usage::

    python tools/mutation_check.py                 # every mutation, 2 in parallel
    python tools/mutation_check.py -k rope         # only mutations whose name contains "rope"
    python tools/mutation_check.py --list          # names and why
    python tools/mutation_check.py --check-only    # only verify that every snippet applies (seconds)

Exit code: 0 when every selected mutation is killed, 1 otherwise. How to add a mutation: docs/testing.md.
"""

from __future__ import annotations

import argparse
import compileall
import concurrent.futures as cf
import importlib.util
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import tomllib

REPO = Path(__file__).resolve().parents[1]
DEFAULT_LIST = REPO / "tools" / "mutations.toml"
REQUIRED = ("name", "file", "original", "replacement", "tests", "why")
# Never copied into the scratch tree (large, or outputs).
SKIP_DIRS = {".git", ".venv", "__pycache__", ".pytest_cache", ".ruff_cache", "ablation-out", "out", "build", "dist"}


@dataclass
class Mutation:
    """One named semantic mutation: in ``file``, ``original`` (found exactly once) becomes ``replacement``."""

    name: str
    file: str
    original: str
    replacement: str
    tests: list[str]
    why: str
    k: str | None = None
    timeout: int = 900
    extra: dict = field(default_factory=dict)

    def selection(self) -> list[str]:
        return [*self.tests, *(["-k", self.k] if self.k else [])]


@dataclass
class Outcome:
    mutation: Mutation
    status: str  # killed | SURVIVED | ERROR
    detail: str
    seconds: float


def load(path: Path) -> list[Mutation]:
    """The mutation list; raises ValueError on a malformed entry or a duplicate name."""
    data = tomllib.loads(path.read_text())
    out: list[Mutation] = []
    seen: set[str] = set()
    for i, raw in enumerate(data.get("mutation", [])):
        missing = [k for k in REQUIRED if k not in raw]
        if missing:
            raise ValueError(f"{path}: mutation #{i} ({raw.get('name', '?')}) lacks {', '.join(missing)}")
        if raw["name"] in seen:
            raise ValueError(f"{path}: duplicate mutation name {raw['name']!r}")
        seen.add(raw["name"])
        tests = raw["tests"] if isinstance(raw["tests"], list) else [raw["tests"]]
        known = {*REQUIRED, "k", "timeout"}
        out.append(
            Mutation(
                name=raw["name"],
                file=raw["file"],
                original=raw["original"],
                replacement=raw["replacement"],
                tests=list(tests),
                why=raw["why"],
                k=raw.get("k"),
                timeout=int(raw.get("timeout", 900)),
                extra={k: v for k, v in raw.items() if k not in known},
            )
        )
    return out


def static_problem(m: Mutation, root: Path) -> str | None:
    """Why ``m`` cannot be applied to the tree at ``root`` (None when it can)."""
    target = root / m.file
    if not target.is_file():
        return f"{m.file} does not exist"
    n = target.read_text().count(m.original)
    if n != 1:
        return f"original snippet found {n} times in {m.file} (must be exactly once; update the entry)"
    if m.original == m.replacement:
        return "replacement equals the original"
    for t in m.tests:
        if not (root / t.split("::")[0]).exists():
            return f"test path {t} does not exist"
    if m.extra:
        return f"unknown keys {sorted(m.extra)}"
    return None


def _copy_tree(src: Path, dst: Path, skip: set[str] = SKIP_DIRS) -> None:
    def ignore(_dir: str, names: list[str]) -> set[str]:
        # .venv-<version>: make venvs' other-version environments (GBs; mutants run with the main .venv's python)
        return {n for n in names if n in skip or n.endswith(".egg-info") or n.startswith(".venv-")}

    shutil.copytree(src, dst, ignore=ignore, symlinks=True)


def compiled_template(root: Path, dst: Path) -> Path:
    """A copy of ``root`` with its Python byte-compiled once: each mutant copies it, so that only the mutated file
    compiles again (copies keep the sources' times, which the bytecode is checked against)."""
    _copy_tree(root, dst)
    compileall.compile_dir(dst, quiet=1, workers=1)
    return dst


def run_one(
    m: Mutation,
    root: Path,
    python: str,
    pytest_args: list[str],
    zygotes: queue.Queue | None = None,
    template: Path | None = None,
) -> Outcome:
    """Apply ``m`` to a scratch copy of ``root`` (of its :func:`compiled_template` when given) and run its selection
    there (forked from a zygote when given)."""
    t0 = time.monotonic()
    problem = static_problem(m, root)
    if problem:
        return Outcome(m, "ERROR", problem, 0.0)
    with tempfile.TemporaryDirectory(prefix="mutant-") as tmp:
        scratch = Path(tmp) / "repo"
        if template is None:
            _copy_tree(root, scratch)
        else:
            _copy_tree(template, scratch, skip=SKIP_DIRS - {"__pycache__"})
        target = scratch / m.file
        target.write_text(target.read_text().replace(m.original, m.replacement, 1))
        Path(importlib.util.cache_from_source(str(target))).unlink(missing_ok=True)
        env = {**os.environ, "PYTHONPATH": str(scratch), "PYTHONDONTWRITEBYTECODE": "1"}
        argv = ["-x", "-q", "-p", "no:cacheprovider", *pytest_args, *m.selection()]
        if zygotes is not None:
            zygote = zygotes.get()
            try:
                out = Path(tmp) / "pytest.out"
                returncode = zygote.run(str(scratch), env, argv, str(out), m.timeout)
                output = out.read_text(errors="replace") if out.exists() else ""
            finally:
                zygotes.put(zygote)
        else:
            try:
                proc = subprocess.run(
                    [python, "-m", "pytest", *argv],
                    cwd=scratch,
                    env=env,
                    capture_output=True,
                    text=True,
                    timeout=m.timeout,
                    check=False,
                )
                returncode, output = proc.returncode, proc.stdout + proc.stderr
            except subprocess.TimeoutExpired:
                returncode, output = None, ""
        if returncode is None:
            # Inconclusive (a hang caused by the mutant, or an overloaded machine): an error, never a kill.
            return Outcome(m, "ERROR", f"selection timed out after {m.timeout} s (inconclusive)", time.monotonic() - t0)
    dt = time.monotonic() - t0
    tail = output.strip().splitlines()
    last = tail[-1] if tail else ""
    if returncode == 0:
        return Outcome(m, "SURVIVED", last, dt)
    if returncode in (1, 2, 3):  # tests failed / collection error (e.g. import) / internal error
        failed = next((ln for ln in tail if ln.startswith("FAILED ")), None)
        failed = failed or next((ln for ln in tail if ln.startswith("ERROR ") and "::" in ln), last)
        return Outcome(m, "killed", failed.split(" - ")[0], dt)
    if returncode == 5:
        return Outcome(m, "ERROR", "the selection collected no tests (update tests/k)", dt)
    return Outcome(m, "ERROR", f"pytest exit code {returncode}: {last}", dt)


def _start_zygotes(python: str, n: int) -> queue.Queue:
    """``n`` pre-imported parents to fork mutants from (tools/mutation_zygote.py)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from mutation_zygote import Zygote

    pool: queue.Queue = queue.Queue()
    for _ in range(n):
        pool.put(Zygote(python, dict(os.environ)))
    return pool


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--list-file", type=Path, default=DEFAULT_LIST, help="the mutation list (TOML)")
    ap.add_argument("--root", type=Path, default=REPO, help="the tree to mutate (default: this repository)")
    ap.add_argument("-k", dest="name_filter", default=None, help="only mutations whose name contains this (comma list)")
    ap.add_argument("-j", "--jobs", type=int, default=2, help="mutants run in parallel (default 2)")
    ap.add_argument("--python", default=sys.executable, help="interpreter that runs pytest")
    ap.add_argument("--list", action="store_true", help="print the mutations and exit")
    ap.add_argument("--check-only", action="store_true", help="only check that every mutation applies")
    ap.add_argument("--pytest-args", default="", help="extra pytest arguments (space separated)")
    ap.add_argument("--no-k", action="store_true", help="ignore the -k selections (run the whole test files)")
    ap.add_argument(
        "--no-zygote",
        action="store_true",
        help="start a new interpreter per mutant instead of forking it from a pre-imported one (tools/mutation_zygote.py)",
    )
    args = ap.parse_args(argv)

    mutations = load(args.list_file)
    if args.no_k:
        for m in mutations:
            m.k = None
    if args.name_filter:
        wanted = [w.strip() for w in args.name_filter.split(",") if w.strip()]
        mutations = [m for m in mutations if any(w in m.name for w in wanted)]
    if args.list:
        for m in mutations:
            print(f"{m.name:55s} {m.file}\n    {m.why}")
        print(f"{len(mutations)} mutations")
        return 0
    root = args.root.resolve()
    if args.check_only:
        bad = [(m.name, p) for m in mutations if (p := static_problem(m, root))]
        for name, p in bad:
            print(f"ERROR    {name}: {p}")
        print(f"mutation check (static): {len(mutations) - len(bad)} of {len(mutations)} apply")
        return 1 if bad else 0

    t0 = time.monotonic()
    print(f"mutation check: {len(mutations)} mutations, {args.jobs} in parallel, tree {root}", flush=True)
    outcomes: list[Outcome] = []
    os.environ["MUTATION_JOBS"] = str(max(1, args.jobs))  # the mutants' torch threads share the cores (conftest)
    zygotes = None if args.no_zygote else _start_zygotes(args.python, max(1, args.jobs))
    tmp = tempfile.TemporaryDirectory(prefix="mutation-template-")
    try:
        template = compiled_template(root, Path(tmp.name) / "repo")
        with cf.ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
            extra = args.pytest_args.split()
            futs = [pool.submit(run_one, m, root, args.python, extra, zygotes, template) for m in mutations]
            for fut in cf.as_completed(futs):
                o = fut.result()
                outcomes.append(o)
                print(f"{o.status:8s} {o.mutation.name:55s} {o.seconds:6.1f} s  {o.detail[:110]}", flush=True)
    finally:
        tmp.cleanup()
        while zygotes is not None and not zygotes.empty():
            zygotes.get().close()
    total = time.monotonic() - t0
    survived = [o for o in outcomes if o.status == "SURVIVED"]
    errors = [o for o in outcomes if o.status == "ERROR"]
    killed = len(outcomes) - len(survived) - len(errors)
    print(
        f"\nmutation check: {killed} of {len(outcomes)} killed, {len(survived)} survived, {len(errors)} errors "
        f"in {total:.0f} s"
    )
    for o in survived:
        print(
            f"  SURVIVED {o.mutation.name}: {o.mutation.why}\n           ({o.mutation.file}; "
            f"ran {' '.join(o.mutation.selection())})"
        )
    for o in errors:
        print(f"  ERROR    {o.mutation.name}: {o.detail}")
    return 1 if survived or errors else 0


if __name__ == "__main__":
    sys.exit(main())
