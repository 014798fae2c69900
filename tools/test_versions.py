#!/usr/bin/env python3
"""Run the version-sensitive checks in every venv of the version matrix and print one summary (``make
test-versions``; issue 22).

For each ``VERSION=VENV`` pair (default: 0.31=.venv-0.31 0.32=.venv-0.32; the Makefile builds them; 0.30 is
``.venv``, where ``make test`` runs the whole suite, the marked tests included), the versions side by side (one
thread each; each step is one process):

1. ``pytest -m versions`` on :data:`MARKED`: the plugin through vLLM-Omni's plugin loader, ``list`` before and after
   the model import, the upstream fingerprint tables against this release, Qwen-Image-2.1 where it exists, default
   vs ``none`` bitwise on the tiny pipelines. No ``VLLM_OMNI_ASCEND_OPT_FORCE``: what installs is decided by the
   upstream code each optimization declares, as users get it;
2. on every version but those in ``--no-selection``, the whole test modules of :data:`SELECTION` whose optimizations declare upstream code that differs from 0.30.0's
   there (asked of the fingerprint tables): the tests of the code each adaptation touches, run unchanged;
3. ``patches/check.py --exactness``: the patch headers, and on 0.32 (the release the series is cut against) every
   patch applied alone and stacked and compared with the plugin on the tiny pipeline; on other versions the script
   says it skips applying (``make test`` covers the headers and the script's logic in tests/test_patches.py).

4. images across releases: ``reference save`` of a tiny set (the 2-block tiny model, 1 prompt, 1 seed, 2 steps) on
   0.30 (``.venv``) and each version's stock (``none``) and ``default`` sets, one at a time beside the versions' test
   steps, then
   each compared with 0.30's (``compare``'s code, in this process). A difference is reported (identical, or the metrics), not failed,
   unless it is outside the close gates (upstream may change stock's images).

Each step's exit code and wall time are printed, then per version what acts on the tiny pipelines and what does not
(with the first reason), from the JSON files tests/test_versions.py writes to ``VERSIONS_REPORT``, and the images
against 0.30's. Exit code 1 when a step failed.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_MATRIX = ("0.31=.venv-0.31", "0.32=.venv-0.32")
#: Modules whose tests marked ``versions`` run on every version.
MARKED = ("tests/test_versions.py", "tests/test_upstream.py", "tests/test_qwen_image_21.py")
#: Whole test modules run on the versions ``make test`` does not cover, each with the optimizations it tests: a module
#: runs on a version where upstream code one of them declares differs from 0.30.0's (the release ``make test`` runs),
#: i.e. where an adaptation or a re-checked seam is (0.31.0rc1: fused_attention's attention layer; 0.32.0rc1: the
#: AdaLayerNorm paths shared_modulation and the fast tier mirror, rope's embedders over the per-instance freqs cache
#: with joint_attention's tables on them, SDPA's reference for fused_attention). Where every declared function is
#: 0.30.0's code, ``make test`` has already run them on that very code.
SELECTION: dict[str, tuple[str, ...]] = {
    "tests/test_shared_modulation.py": ("shared_modulation",),
    "tests/test_fast_tier.py": ("fast_modulate", "fast_residual", "shared_modulation"),
    "tests/test_rope.py": ("rope",),
    "tests/test_joint_attention.py": ("joint_attention", "rope"),
    "tests/test_fused_attention.py": ("fused_attention",),
}
BASE_RELEASE = "0.30.0"
#: The cross-release image check's workload: the smallest that runs every default optimization (one worker start
#: per set is the cost).
REF_WORKLOAD = {"model": "tiny", "height": 32, "width": 32, "steps": 2, "seeds": [42], "threads": 1}
REF_CONFIGS = ("none", "default")
_CHANGED = (
    "import json; from vllm_omni_ascend_opt import registry; from vllm_omni_ascend_opt.blocks.upstream import fingerprints; "
    "print(json.dumps(sorted({o.name for o in registry.all_optimizations() "
    f"for f in fingerprints.check(o.upstream) if {BASE_RELEASE!r} not in f.decl.known.get(f.fingerprint, ())}})))"
)


def changed_since_base(python: Path) -> list[str] | None:
    """Optimizations whose declared upstream code (any platform's) is not 0.30.0's in ``python``'s venv (None: the
    question failed; then every module of :data:`SELECTION` runs)."""
    r = subprocess.run([str(python), "-c", _CHANGED], capture_output=True, text=True, env=_env({}), cwd=REPO)
    try:
        return list(json.loads(r.stdout.strip().splitlines()[-1]))
    except (ValueError, IndexError):
        return None


def selection_for(changed: list[str] | None) -> list[str]:
    """The modules of :data:`SELECTION` to run for the optimizations in ``changed`` (None: all)."""
    return [m for m, opts in SELECTION.items() if changed is None or set(opts) & set(changed)]


def _env(extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "VLLM_OMNI_ASCEND_OPT_FORCE"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    env.update(extra)
    return env


def _step(label: str, cmd: list[str], env: dict[str, str], log: Path) -> tuple[str, int, float]:
    """Run ``cmd`` with its output in ``log``; (label, exit code, seconds)."""
    t0 = time.monotonic()
    with open(log, "w") as fh:
        fh.write(f"=== {label}: {' '.join(cmd)}\n")
        fh.flush()
        rc = subprocess.run(cmd, cwd=REPO, env=env, stdout=fh, stderr=subprocess.STDOUT, text=True).returncode
    dt = time.monotonic() - t0
    with open(log, "a") as fh:
        fh.write(f"=== {label}: exit {rc} in {dt:.0f} s\n")
    return label, rc, dt


def _cli(python: Path | str) -> list[str]:
    return [str(python), "-m", "vllm_omni_ascend_opt.cli"]


def save_base_set(tmp: Path) -> tuple[str, int, float]:
    """0.30's reference set (``.venv``, the interpreter running this script), saved while the versions run."""
    wl = tmp / "ref-workload.json"
    cmd = [
        *_cli(sys.executable),
        "reference",
        "save",
        "--workload",
        str(wl),
        "--tensors",
        "--out",
        str(tmp / "ref-0.30"),
    ]
    return _step("0.30: reference save (none)", cmd, _env({}), tmp / "ref-0.30.log")


def save_sets(pair: str, tmp: Path) -> list[tuple[str, int, float]]:
    """A version's stock and default sets (``reference save`` in its venv)."""
    version, venv = pair.split("=", 1)
    python = (REPO / venv / "bin" / "python").absolute()
    if not python.exists():
        return []
    wl = tmp / "ref-workload.json"
    results = []
    for config in REF_CONFIGS:
        out = tmp / f"ref-{version}-{config}"
        cmd = [*_cli(python), "reference", "save", "--workload", str(wl), "--config", config, "--tensors"]
        results.append(
            _step(f"{version}: reference save ({config})", [*cmd, "--out", str(out)], _env({}), tmp / f"{out.name}.log")
        )
    return results


def save_all_sets(matrix: list[str], tmp: Path) -> list[tuple[str, int, float]]:
    """0.30's set, then each version's, one process at a time beside the versions' test steps (one extra process
    on the CPUs rather than five at once)."""
    return [save_base_set(tmp), *(step for pair in matrix for step in save_sets(pair, tmp))]


def compare_sets(version: str, tmp: Path) -> tuple[list[tuple[str, int, float]], list[str]]:
    """Each of ``version``'s sets against 0.30's (``compare``'s code, in this process): a step per set that fails
    only outside the close gates or when nothing could be compared, and one line each for the summary."""
    sys.path.insert(0, str(REPO))
    from vllm_omni_ascend_opt.ablation import refset, setcompare

    steps, lines = [], []
    for config in REF_CONFIGS:
        t0 = time.monotonic()
        label = f"{version}: images vs 0.30 ({config})"
        try:
            a, b = refset.load(tmp / "ref-0.30"), refset.load(tmp / f"ref-{version}-{config}")
            res = setcompare.run_compare(a, b)
            setcompare.write(res, a, b, tmp / f"cmp-{version}-{config}")
        except (refset.SetError, OSError) as exc:
            steps.append((label, 2, time.monotonic() - t0))
            lines.append(f"  images vs 0.30, {config}: not compared: {exc}")
            continue
        steps.append((label, res["exit_code"], time.monotonic() - t0))
        lines.append(_images_line(config, res))
    return steps, lines


def _images_line(config: str, res: dict) -> str:
    """One line of the cross-release table: identical, or the metrics."""
    pairs = res["pairs"]
    if not pairs:
        return f"  images vs 0.30, {config}: nothing compared ({res['verdict']})"
    if all(p["tensors"] and p["tensors"]["bitwise_identical"] for p in pairs):
        what = "bitwise-identical"
    elif all(p["pixel_identical"] for p in pairs):
        what = "pixel-identical (float outputs differ)"
    else:
        w = res["gate"]["worst"]
        what = f"differ: SSIM {w['ssim_min']:.4f}, PSNR {w['psnr_db_min']:.2f} dB, max |d| {w['max_abs_diff']:.3g}"
    gate = "within" if res["exit_code"] == 0 else "OUTSIDE"
    return f"  images vs 0.30, {config}: {what} ({gate} the close gates)"


def _summary(version: str, report: Path, check_log: Path) -> list[str]:
    """What acts per pipeline, what does not and why (grouped), and the patch verdicts, for one version."""
    lines: list[str] = []
    off: dict[str, str] = {}
    omni = version
    for kind in ("t2i", "edit"):
        f = report / f"acting_{kind}.json"
        if not f.exists():
            lines.append(f"  {kind}: no report (the test did not get that far)")
            continue
        data = json.loads(f.read_text())
        omni = data["vllm_omni"]
        lines.append(f"  {kind} (default): acting {', '.join(data['acting']) or 'nothing'}")
        off.update({n: r[0] for n, r in data["reasons"].items() if r})
    groups: dict[str, list[str]] = {}
    for name, why in off.items():
        key = "no torch_npu" if "torch_npu is not installed" in why else why
        groups.setdefault(key, []).append(name)
    for why, names in groups.items():
        lines.append(f"  off {', '.join(names)}: {why}")
    f = report / "plugin_loader.json"
    if f.exists():
        data = json.loads(f.read_text())
        gate = f" (refused: {data['version_error']})" if data.get("version_error") else ""
        lines.append(f"  plugin loader: installed {', '.join(data['installed']) or 'nothing'}{gate}")
        off = {n: r[0] for n, r in data.get("reasons", {}).items() if r and n in data.get("selected", [])}
        for name, why in off.items():
            if "torch_npu" not in why:
                lines.append(f"  plugin loader: {name} off: {why}")
    if check_log.exists():  # patches/check.py's last line: "summary: vllm-omni V, series against B: ..."
        done = [ln for ln in check_log.read_text().splitlines() if ln.startswith("summary: ")]
        lines.append(f"  patches: {done[-1].split(': ', 1)[1] if done else 'no summary (check.py did not finish)'}")
    return [f"vllm-omni {omni}:", *lines]


def _version(pair: str, tmp: Path, selection: bool, pytest_args: str) -> tuple[list[tuple[str, int, float]], list[str]]:
    """Every step for one ``VERSION=VENV`` pair, one after the other; each step's log is printed when it ends."""
    version, venv = pair.split("=", 1)
    python = (REPO / venv / "bin" / "python").absolute()
    if not python.exists():
        print(f"{venv} has no bin/python; build it with make {venv}/.ascend-opt-installed", flush=True)
        return [(f"{version}: venv {venv}", 1, 0.0)], []
    report = tmp / version
    env = _env({"VERSIONS_REPORT": str(report)})
    pytest = [str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rxXs", *pytest_args.split()]
    steps = [(f"{version}: pytest -m versions", [*pytest, "-m", "versions", *MARKED], env, tmp / f"{version}-m.log")]
    if selection:
        changed = changed_since_base(python)
        mods = selection_for(changed)
        print(f"{version}: upstream code not as in {BASE_RELEASE} for {changed}: runs {mods}", flush=True)
        if mods:
            label = f"{version}: pytest ({', '.join(changed or ['all'])})"
            steps.append((label, [*pytest, *mods], env, tmp / f"{version}-s.log"))
    check_log = tmp / f"{version}-check.log"
    steps.append(
        (
            f"{version}: patches/check.py --exactness",
            [str(python), "patches/check.py", "--exactness"],
            _env({}),
            check_log,
        )
    )
    results = []
    for label, cmd, step_env, log in steps:
        results.append(_step(label, cmd, step_env, log))
        with _PRINT:
            sys.stdout.write(log.read_text())
            sys.stdout.flush()
    return results, _summary(version, report, check_log)


_PRINT = threading.Lock()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("matrix", nargs="*", default=list(DEFAULT_MATRIX), help="VERSION=VENV pairs")
    ap.add_argument("--no-selection", default="", help="comma list of versions to run without SELECTION")
    ap.add_argument("--pytest-args", default="", help="extra pytest arguments")
    args = ap.parse_args(argv)
    no_selection = set(filter(None, args.no_selection.split(",")))

    t_all = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="test-versions-") as tmp:
        (Path(tmp) / "ref-workload.json").write_text(json.dumps(REF_WORKLOAD))
        with concurrent.futures.ThreadPoolExecutor(max_workers=len(args.matrix) + 1) as pool:
            images = pool.submit(save_all_sets, args.matrix, Path(tmp))
            runs = [
                pool.submit(_version, pair, Path(tmp), pair.split("=", 1)[0] not in no_selection, args.pytest_args)
                for pair in args.matrix
            ]
            done = [r.result() for r in runs]
            saved = images.result()
        for log in sorted(Path(tmp).glob("ref-*.log")):
            sys.stdout.write(log.read_text())
        compared = [compare_sets(pair.split("=", 1)[0], Path(tmp)) for pair in args.matrix]
    results = [
        *saved,
        *(step for steps, _ in done for step in steps),
        *(step for steps, _ in compared for step in steps),
    ]
    summaries = []
    for (_, lines), (_, image_lines) in zip(done, compared, strict=True):
        summaries += [*lines, *image_lines]
    total = time.monotonic() - t_all
    print("\n================ test-versions summary ================")
    for label, rc, dt in results:
        print(f"{'ok  ' if rc == 0 else 'FAIL'} {label} ({dt:.0f} s)")
    print(*summaries, sep="\n")
    print(f"total {total:.0f} s (versions side by side)")
    return 1 if any(rc for _, rc, _ in results) else 0


if __name__ == "__main__":
    sys.exit(main())
