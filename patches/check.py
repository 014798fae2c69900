#!/usr/bin/env python
"""Check the upstream patch series against a pristine vLLM-Omni tree, and against the plugin.

    python patches/check.py              # headers; on vLLM-Omni 0.32.x also git apply --check / apply, each patch
                                         # alone and all in order
    python patches/check.py --exactness  # + each patch's upstream code vs the plugin, bitwise, on the tiny pipeline

The series (``patches/000N-<name>.patch``) is cut against vLLM-Omni 0.32.0rc1 (:data:`BASE`). Headers are checked
on any installed version; applying and exactness need that release's source, so they run when the installed
vLLM-Omni is 0.32.x and are skipped, saying so, on any other (``make test-versions`` runs this script in the 0.32
venv with ``--exactness``).

The pristine tree is the installed ``vllm_omni`` package, verified file by file against the sha256 hashes in its
wheel's RECORD (so a locally modified install is refused), copied to a temporary directory.

Exactness (the drift check between the plugin and the patches): the tiny test-bed pipeline runs three requests
(two resolutions, CFG off and on, the first request repeated so warm caches are hit) in fresh processes:

* one process per patch on the patched upstream tree with the plugin off (``none``);
* ONE process on the stock tree that toggles in-process (``api.select(spec, model=pipe)``) between ``none`` (stock)
  and ``none,+name`` for every patched optimization.

A patch passes when its images are ``torch.equal`` to the plugin's with that optimization on, its kernel-launching
aten op counts (testbed.opcount) equal the plugin's per request (the same computation, not merely the same result),
and those counts differ from stock's (the patched code actually ran). An optimization that acts through others
(``Optimization.needs``: the fast tier is a mode of shared_modulation's block body) is compared as
``none,+<needs>,+name``, and its op counts by what they save: the patch on the pristine tree must save, op by op, exactly
what the plugin's mode saves against ``none,+<needs>``. An ``exact`` patch must also equal stock
bitwise. A patch whose optimization cannot be active on this machine (NPU-only kernels) is reported as skipped
with the plugin's reason. A patch whose optimization the plugin refuses here for another reason (e.g. upstream code
it does not recognise: a newer version than its fingerprints know) is checked against stock alone (status
``stock``): an exact patch must equal stock bitwise, an approximate one must meet its gates against stock, and its
op counts must differ from stock's. That is not a failure of the patch; the plugin's side is then unchecked.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
PATCH_RE = re.compile(r"^(\d{4})-([a-z_]+)\.patch$")
#: Header fields every patch must carry (free text before the first ``diff --git`` line).
REQUIRED_FIELDS = (
    "What",
    "Why",
    "How",
    "Equivalence",
    "Measured effect",
    "Risks",
    "Base",
    "Upstream overlap",
    "Removal plan",
)


#: The vLLM-Omni release the series is cut against, and the installed releases (major.minor) it is applied on.
BASE = "0.32.0rc1"
TARGET = "0.32"
#: The requests every exactness run makes: (cfg_scale, (height, width), seed).
REQUESTS = ((1.0, (32, 48), 3), (2.5, (48, 32), 4), (1.0, (32, 48), 3))
STEPS = 3


def patch_files() -> list[Path]:
    """The patches, in order."""
    return sorted(p for p in HERE.glob("*.patch") if PATCH_RE.match(p.name))


def installed_version() -> str | None:
    """The installed vLLM-Omni version, or None."""
    try:
        return importlib.metadata.version("vllm-omni")
    except importlib.metadata.PackageNotFoundError:
        return None


def applies_to(version: str | None) -> bool:
    """Whether the series is applied and compared on the installed vLLM-Omni ``version`` (a 0.32.x release)."""
    return version is not None and ".".join(version.split(".")[:2]) == TARGET


def optimization_of(patch: Path) -> str:
    m = PATCH_RE.match(patch.name)
    assert m, patch
    return m.group(2)


def header_fields(patch: Path) -> dict[str, str]:
    """The ``Key: value`` lines of the free-text header before the first ``diff --git``."""
    fields: dict[str, str] = {}
    key = None
    for line in patch.read_text().splitlines():
        if line.startswith("diff --git"):
            break
        m = re.match(r"^([A-Z][A-Za-z ]+):\s*(.*)$", line)
        if m:
            key = m.group(1).strip()
            fields[key] = m.group(2).strip()
        elif key and line.strip():
            fields[key] += " " + line.strip()
    return fields


def enable_env(patch: Path) -> dict[str, str]:
    """Environment a patch's code needs to be switched on (optional header field ``Enable: NAME=VALUE ...``, for
    opt-in patches such as approximate ones); the exactness run sets it for that patch's upstream process."""
    text = header_fields(patch).get("Enable", "")
    return dict(tok.split("=", 1) for tok in text.split() if re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S+", tok))


def header_problems(patch: Path) -> list[str]:
    """What is wrong with the header: required fields absent or empty, a ``Base`` that does not name :data:`BASE`."""
    fields = header_fields(patch)
    problems = [f"missing {f}" for f in REQUIRED_FIELDS if not fields.get(f, "").strip()]
    if fields.get("Base") and BASE not in fields["Base"]:
        problems.append(f"Base does not name {BASE}")
    return problems


_VERIFIED: list[Path] = []


def installed_source() -> Path:
    """The installed ``vllm_omni`` package directory, verified once per process against the wheel RECORD."""
    if _VERIFIED:
        return _VERIFIED[0]
    dist = importlib.metadata.distribution("vllm-omni")
    bad = []
    for f in dist.files or []:
        if f.parts[0] != "vllm_omni" or f.hash is None or f.hash.mode != "sha256":
            continue
        data = Path(dist.locate_file(f)).read_bytes()
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        if digest != f.hash.value:
            bad.append(str(f))
    if bad:
        raise SystemExit(
            f"installed vllm_omni differs from the {dist.version} wheel in {len(bad)} files, e.g. {bad[:3]}"
        )
    _VERIFIED.append(Path(dist.locate_file("vllm_omni")))
    return _VERIFIED[0]


def pristine_tree(dest: Path) -> Path:
    """Copy the installed vllm_omni package into ``dest/vllm_omni`` after verifying it against the wheel RECORD."""
    shutil.copytree(installed_source(), dest / "vllm_omni", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return dest


def git_apply(patch: Path, tree: Path, check_only: bool) -> subprocess.CompletedProcess:
    cmd = ["git", "apply", "--check" if check_only else "--whitespace=nowarn", str(patch)]
    return subprocess.run(cmd, cwd=tree, capture_output=True, text=True)


def touched_files(patch: Path) -> list[str]:
    """Paths (relative to the tree root) the patch creates or modifies."""
    return [m.group(1) for m in re.finditer(r"^\+\+\+ b/(\S+)", patch.read_text(), re.M)]


def compile_errors(patch: Path, tree: Path) -> str:
    """Syntax errors in the Python files ``patch`` touched in ``tree`` ("" when all compile); covers NPU-only code
    that no CPU run executes."""
    errors = []
    for rel in touched_files(patch):
        if rel.endswith(".py"):
            try:
                compile((tree / rel).read_text(), str(tree / rel), "exec")
            except SyntaxError as exc:
                errors.append(f"{rel}: {exc}")
    return "; ".join(errors)


def apply_checks(patches: list[Path], workdir: Path) -> list[tuple[Path, str, bool, str]]:
    """``git apply --check`` then apply, each patch alone on its own pristine tree and all stacked in order.

    Returns (patch, "alone"|"stacked", ok, message). The alone trees are kept as ``workdir/<stem>`` for reuse."""
    results = []
    stack = pristine_tree(workdir / "stack")
    for p in patches:
        for tree, label in ((pristine_tree(workdir / p.stem), "alone"), (stack, "stacked")):
            msg = "applies, touched Python files compile"
            ok = True
            for check_only in (True, False):
                r = git_apply(p, tree, check_only)
                if r.returncode:
                    ok, msg = False, f"{'check' if check_only else 'apply'}: {r.stderr.strip()}"
                    break
            if ok and (errors := compile_errors(p, tree)):
                ok, msg = False, f"applies but does not compile: {errors}"
            results.append((p, label, ok, msg))
    return results


# ----------------------------------------------------------------------------------------------------------------
# generations in fresh processes
# ----------------------------------------------------------------------------------------------------------------
_GEN = r"""
import json, os, sys, time, torch
t0 = time.perf_counter()
torch.set_num_threads(int(os.environ.get("CHECK_THREADS", "1")))
from vllm_omni_ascend_opt import api, registry
from vllm_omni_ascend_opt.testbed import build_model_dir
from vllm_omni_ascend_opt.testbed.opcount import OpCounter
from vllm_omni_ascend_opt.testbed.runtime import init_cpu_runtime
from vllm_omni_ascend_opt.testbed.pipeline import load_pipeline, generate
import vllm_omni
out, root, requests, steps, specs = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), int(sys.argv[4]), sys.argv[5:]
assert os.path.realpath(vllm_omni.__file__).startswith(os.path.realpath(root)), (vllm_omni.__file__, root)
api.select("none")
rt = init_cpu_runtime(str(build_model_dir()))
pipe = load_pipeline(rt)
from vllm_omni.diffusion.models.qwen_image import qwen_image_transformer as qt
memos = [f for c in vars(qt).values() if isinstance(c, type) for f in vars(c).values() if hasattr(f, "cache_clear")]
# 0.32+: the RoPE freqs caches are per module instance (a bounded OrderedDict, upstream #8016), not lru_caches
caches = [m._freqs_cache for m in pipe.modules() if isinstance(getattr(m, "_freqs_cache", None), dict)]
results = {}
for spec in specs:
    for f in memos:  # upstream's own RoPE freqs caches: every spec starts as in a fresh process
        f.cache_clear()
    for c in caches:
        c.clear()
    api.select("none", model=pipe)  # and the plugin's (uninstall drops them), also between specs sharing an opt
    api.select(spec, model=pipe)
    names = [n for n in spec.split(",") if n.startswith("+")]
    inactive = {n[1:]: registry.get(n[1:]).reasons_inactive(pipe)
                for n in names}
    images, ops = [], []
    for cfg, (h, w), seed in requests:
        with OpCounter() as c:
            r = generate(pipe, rt, "a red cat", height=h, width=w, steps=steps, seed=seed, cfg_scale=cfg)
        images.append(r.images)
        print(spec, h, w, cfg, f"{time.perf_counter() - t0:.1f} s", flush=True)
        ops.append(dict(c.counts))
    results[spec] = {"images": images, "ops": ops, "inactive": inactive}
api.select("none", model=pipe)
torch.save(results, out)
"""


@dataclass
class Job:
    """One fresh process: ``tree`` (None = the installed stock tree) and the specs it generates in order."""

    tree: Path | None
    specs: list[str]
    out: Path
    env: dict[str, str] = field(default_factory=dict)
    proc: Any = None
    result: dict[str, Any] = field(default_factory=dict)
    error: str = ""


def _start(job: Job, threads: int) -> None:
    env = {**os.environ, **job.env, "VLLM_OMNI_ASCEND_OPT": "none", "CHECK_THREADS": str(threads)}
    if job.tree is not None:
        root = str(job.tree / "vllm_omni")
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(job.tree), str(REPO), env.get("PYTHONPATH", "")) if p)
    else:
        root = str(installed_source())
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    import json

    args = [sys.executable, "-c", _GEN, str(job.out), root, json.dumps(REQUESTS), str(STEPS), *job.specs]
    job.proc = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def run_jobs(jobs: list[Job], parallel: int = 2, timeout: float = 600) -> None:
    """Run ``jobs`` at most ``parallel`` at a time (one torch thread each); fill ``result`` or ``error``."""
    import torch

    pending, running = list(jobs), []
    threads = max(1, (os.cpu_count() or 2) // max(1, parallel))
    while pending or running:
        while pending and len(running) < parallel:
            job = pending.pop(0)
            _start(job, threads)
            running.append(job)
        job = running.pop(0)
        try:
            log, _ = job.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            job.proc.kill()
            log, _ = job.proc.communicate()
            job.error = f"timed out after {timeout} s"
        if job.proc.returncode != 0 and not job.error:
            job.error = f"exit {job.proc.returncode}:\n{(log or '')[-4000:]}"
        if not job.error:
            job.result = torch.load(job.out, weights_only=False)


@dataclass
class Verdict:
    patch: Path
    status: str  # "ok", "FAIL", "skip", "stock" (the plugin's side refused here: checked against stock only)
    message: str


def _ops_total(ops: list[dict[str, int]]) -> list[int]:
    return [sum(o.values()) for o in ops]


def _op_diff(a: dict[str, int], b: dict[str, int]) -> str:
    keys = sorted(set(a) | set(b))
    return ", ".join(f"{k}: {a.get(k, 0)} vs {b.get(k, 0)}" for k in keys if a.get(k, 0) != b.get(k, 0))


def plugin_base(name: str) -> str:
    """The plugin configuration a patch's optimization is measured against: stock, or what it needs."""
    from vllm_omni_ascend_opt import registry

    return ",".join(["none", *(f"+{n}" for n in registry.get(name).needs)])


def plugin_spec(name: str) -> str:
    """The plugin configuration whose images and op savings the patch must reproduce."""
    return f"{plugin_base(name)},+{name}"


def _saved(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    """Per op name, how many fewer launches ``after`` makes than ``before`` (negative: more); zeros dropped."""
    keys = set(before) | set(after)
    return {k: before.get(k, 0) - after.get(k, 0) for k in sorted(keys) if before.get(k, 0) != after.get(k, 0)}


def check_exactness(patches: list[Path], workdir: Path, parallel: int = 2) -> list[Verdict]:
    """Patched upstream (one process per patch) vs the plugin (one shared process), see the module docstring.

    ``workdir/<stem>`` may already hold the patched tree from :func:`apply_checks`; otherwise it is made here."""
    import torch

    from vllm_omni_ascend_opt import _backend, registry

    verdicts: list[Verdict] = []
    trees: dict[Path, Path] = {}
    npu_why = _backend.npu_unavailable_reasons()
    for p in patches:
        why = registry.get(optimization_of(p)).reasons_inactive()
        if why and npu_why and all(r in npu_why for r in why):
            # NPU-only: the patched code cannot run here either, so no process is started for it
            verdicts.append(Verdict(p, "skip", f"{optimization_of(p)} cannot be active here: {'; '.join(why)}"))
            continue
        tree = workdir / p.stem
        if not (tree / "vllm_omni").exists():
            pristine_tree(tree)
            r = git_apply(p, tree, check_only=False)
            if r.returncode:
                verdicts.append(Verdict(p, "FAIL", f"does not apply: {r.stderr.strip()}"))
                continue
        trees[p] = tree
    names = [optimization_of(p) for p in trees]
    specs = ["none"]
    for n in names:  # an optimization that acts through others (Optimization.needs): compared on top of them
        for spec in (plugin_base(n), plugin_spec(n)):
            if spec not in specs:
                specs.append(spec)
    plugin = Job(None, specs, workdir / "plugin.pt")
    upstream = {p: Job(t, ["none"], workdir / f"{p.stem}-upstream.pt", enable_env(p)) for p, t in trees.items()}
    run_jobs([plugin, *upstream.values()], parallel=parallel)
    if plugin.error:
        return [*verdicts, *(Verdict(p, "FAIL", f"plugin run failed: {plugin.error}") for p in trees)]
    stock = plugin.result["none"]
    for p, job in upstream.items():
        name = optimization_of(p)
        exact = registry.get(name).equivalence == "exact"
        mine = plugin.result[plugin_spec(name)]
        base = plugin.result[plugin_base(name)]
        why = [r for rs in mine["inactive"].values() for r in rs]
        if job.error:
            verdicts.append(Verdict(p, "FAIL", f"patched upstream run failed: {job.error}"))
            continue
        up = job.result["none"]
        if why:
            verdicts.append(_against_stock(p, name, up, stock, why))
            continue
        problems = []
        same = [torch.equal(a, b) for a, b in zip(up["images"], mine["images"], strict=True)]
        if not all(same):
            diffs = [float((a - b).abs().max()) for a, b in zip(up["images"], mine["images"], strict=True)]
            problems.append(f"images differ from the plugin's (max |diff| per request {diffs})")
        if base is stock:
            for i, (a, b) in enumerate(zip(up["ops"], mine["ops"], strict=True)):
                if a != b:
                    problems.append(
                        f"request {i}: op counts differ from the plugin's (patch vs plugin: {_op_diff(a, b)})"
                    )
        else:  # the plugin's mode runs inside what it needs: the patch must save exactly the ops the mode saves
            for i, (s0, a, b0, b) in enumerate(zip(stock["ops"], up["ops"], base["ops"], mine["ops"], strict=True)):
                saved_up, saved_plugin = _saved(s0, a), _saved(b0, b)
                if saved_up != saved_plugin:
                    problems.append(
                        f"request {i}: the patch saves {saved_up} ops vs stock, the plugin's {name} saves "
                        f"{saved_plugin} vs {plugin_base(name)}"
                    )
        if exact and not all(torch.equal(a, b) for a, b in zip(up["images"], stock["images"], strict=True)):
            problems.append("images differ from stock although the optimization is exact")
        if up["ops"] == stock["ops"]:
            problems.append("op counts equal stock's: the patched code did not run")
        totals = f"ops per request: stock {_ops_total(stock['ops'])}, patched {_ops_total(up['ops'])}"
        if problems:
            verdicts.append(Verdict(p, "FAIL", "; ".join(problems) + f" ({totals})"))
        else:
            what = "bitwise equal to the plugin and to stock" if exact else "bitwise equal to the plugin"
            ops = (
                "same op counts" if base is stock else f"same op savings as {plugin_spec(name)} vs {plugin_base(name)}"
            )
            verdicts.append(Verdict(p, "ok", f"{what}, {ops} ({totals})"))
    return verdicts


def _against_stock(patch: Path, name: str, up: dict[str, Any], stock: dict[str, Any], why: list[str]) -> Verdict:
    """The plugin's ``name`` is off here for a reason other than a missing NPU: check the patched tree against stock
    alone (exact: bitwise; approximate: its gates), and that its code ran (op counts differ from stock's)."""
    import torch

    from vllm_omni_ascend_opt import registry
    from vllm_omni_ascend_opt.ablation import metrics

    opt = registry.get(name)
    problems = []
    if opt.equivalence == "exact":
        if not all(torch.equal(a, b) for a, b in zip(up["images"], stock["images"], strict=True)):
            problems.append("images differ from stock although the optimization is exact")
    else:
        ssim, psnr = opt.close_gates or (metrics.SSIM_GATE, metrics.PSNR_GATE_DB)
        for i, (a, b) in enumerate(zip(stock["images"], up["images"], strict=True)):
            m = metrics.compare_images(a, b)
            if not metrics.passes_gates(m, ssim_min=ssim, psnr_min=psnr):
                problems.append(f"request {i}: SSIM {m['ssim']:.5f} / PSNR {m['psnr']:.1f} dB below {ssim} / {psnr}")
    if up["ops"] == stock["ops"]:
        problems.append("op counts equal stock's: the patched code did not run")
    totals = f"ops per request: stock {_ops_total(stock['ops'])}, patched {_ops_total(up['ops'])}"
    if problems:
        return Verdict(patch, "FAIL", "; ".join(problems) + f" ({totals})")
    what = "bitwise equal to stock" if opt.equivalence == "exact" else "within its gates against stock"
    return Verdict(
        patch, "stock", f"{what}, op counts differ ({totals}); the plugin's {name} is off here: {'; '.join(why)}"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--exactness",
        action="store_true",
        help="also compare each patch's upstream code with the plugin (where the series applies)",
    )
    ap.add_argument("--parallel", type=int, default=2, help="generation processes at once (default 2)")
    args = ap.parse_args(argv)

    patches = patch_files()
    bad = 0
    for p in patches:
        problems = header_problems(p)
        bad += bool(problems)
        print(f"{'FAIL' if problems else 'ok  '} {p.name} header{': ' + '; '.join(problems) if problems else ''}")
    version = installed_version()
    summary = f"summary: vllm-omni {version}, series against {BASE}: headers {len(patches) - bad} ok, {bad} FAIL"
    if not applies_to(version):
        what = "apply and exactness checks" if args.exactness else "apply checks"
        print(f"--   the series targets vLLM-Omni {BASE}: {what} skipped on the installed vllm-omni {version}")
        print(f"{summary}; not applied (needs vllm-omni {TARGET}.x)")
        return int(bad > 0)
    failed = bad > 0
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        applied = apply_checks(patches, work)
        for p, label, ok, msg in applied:
            print(f"{'ok  ' if ok else 'FAIL'} {p.name} ({label}): {msg}")
        n_bad = sum(not ok for *_, ok, _ in applied)
        failed |= n_bad > 0
        summary += f"; apply {len(applied) - n_bad} ok, {n_bad} FAIL"
        if args.exactness:
            verdicts = check_exactness(patches, work, parallel=args.parallel)
            for v in verdicts:
                print(f"{v.status:5} {v.patch.name} vs plugin: {v.message}")
            failed |= any(v.status == "FAIL" for v in verdicts)
            by_status: dict[str, list[str]] = {}
            for v in verdicts:
                by_status.setdefault(v.status, []).append(v.patch.name[:4])
            summary += "; vs plugin: " + ", ".join(f"{k} {' '.join(v)}" for k, v in by_status.items())
    print(summary)
    return int(failed)


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    raise SystemExit(main())
