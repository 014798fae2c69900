#!/usr/bin/env python
"""Check the upstream patches against a pristine vLLM-Omni 0.30.0 tree, and against the plugin.

    python patches/check.py              # git apply --check + apply, each patch alone and all in order
    python patches/check.py --exactness  # + for each `exact` patch: patched upstream == plugin, bitwise

The pristine tree is the installed ``vllm_omni`` package, verified file by file against the sha256 hashes in its
wheel's RECORD (so a locally modified install is refused), copied to a temporary directory. Exactness runs the tiny
test-bed pipeline twice in fresh processes: once on the patched upstream tree with the plugin off
(``VLLM_OMNI_ASCEND_OPT=none``), once on the stock tree with only the matching optimization on, and requires
``torch.equal`` on the images. This is how the plugin and the patches are kept from drifting apart.
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
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
PATCH_RE = re.compile(r"^(\d{4})-([a-z_]+)\.patch$")


def patch_files() -> list[Path]:
    return sorted(p for p in HERE.glob("*.patch") if PATCH_RE.match(p.name))


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


def pristine_tree(dest: Path) -> Path:
    """Copy the installed vllm_omni package into ``dest`` after verifying it against the wheel RECORD."""
    dist = importlib.metadata.distribution("vllm-omni")
    if not dist.version.startswith("0.30."):
        raise SystemExit(f"vllm-omni {dist.version} installed; the patches target 0.30.x")
    bad = []
    for f in dist.files or []:
        if f.parts[0] != "vllm_omni" or f.hash is None or f.hash.mode != "sha256":
            continue
        data = Path(dist.locate_file(f)).read_bytes()
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        if digest != f.hash.value:
            bad.append(str(f))
    if bad:
        raise SystemExit(f"installed vllm_omni differs from the 0.30.0 wheel in {len(bad)} files, e.g. {bad[:3]}")
    src = Path(dist.locate_file("vllm_omni"))
    shutil.copytree(src, dest / "vllm_omni", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return dest


def git_apply(patch: Path, tree: Path, check_only: bool) -> subprocess.CompletedProcess:
    cmd = ["git", "apply", "--check" if check_only else "--whitespace=nowarn", str(patch)]
    return subprocess.run(cmd, cwd=tree, capture_output=True, text=True)


_GEN = r"""
import sys, torch
from vllm_omni_ascend_opt import api
from vllm_omni_ascend_opt.testbed import build_model_dir
from vllm_omni_ascend_opt.testbed.runtime import init_cpu_runtime
from vllm_omni_ascend_opt.testbed.pipeline import load_pipeline, generate
import vllm_omni
assert vllm_omni.__file__.startswith(sys.argv[2]), (vllm_omni.__file__, sys.argv[2])
api.select(sys.argv[3])
rt = init_cpu_runtime(str(build_model_dir()))
pipe = load_pipeline(rt)
outs = []
for cfg, (h, w), seed in [(1.0, (32, 48), 3), (2.5, (48, 32), 4), (1.0, (32, 48), 3)]:
    outs.append(generate(pipe, rt, "a red cat", height=h, width=w, steps=3, seed=seed, cfg_scale=cfg).images)
torch.save(outs, sys.argv[1])
"""


def generate_images(tree: Path | None, spec: str, out: Path) -> list:
    """Run the tiny pipeline in a fresh process on ``tree`` (None = the installed stock tree)."""
    import torch

    env = {**os.environ, "VLLM_OMNI_ASCEND_OPT": "none"}
    root = str(tree) if tree is not None else str(Path(importlib.metadata.distribution("vllm-omni").locate_file("")))
    if tree is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(tree), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, "-c", _GEN, str(out), root, spec], env=env, capture_output=True, text=True, timeout=600
    )
    if proc.returncode != 0:
        raise RuntimeError(f"generation failed on {root} with {spec!r}:\n{proc.stderr[-4000:]}")
    return torch.load(out)


def check_exact(patch: Path, workdir: Path) -> tuple[bool, str]:
    import torch

    tree = pristine_tree(workdir / f"tree-{patch.stem}")
    r = git_apply(patch, tree, check_only=False)
    if r.returncode:
        return False, r.stderr
    upstream = generate_images(tree, "none", workdir / f"{patch.stem}-upstream.pt")
    plugin = generate_images(None, f"none,+{optimization_of(patch)}", workdir / f"{patch.stem}-plugin.pt")
    same = [torch.equal(a, b) for a, b in zip(upstream, plugin, strict=True)]
    diffs = [float((a - b).abs().max()) for a, b in zip(upstream, plugin, strict=True)]
    return all(same), f"bitwise equal per request: {same}; max |diff| {diffs}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--exactness", action="store_true", help="also compare each exact patch with the plugin")
    args = ap.parse_args()
    from vllm_omni_ascend_opt import registry

    failed = False
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        stack = pristine_tree(work / "stack")
        for p in patch_files():
            for tree, label in ((pristine_tree(work / p.stem), "alone"), (stack, "stacked")):
                for check_only in (True, False):
                    r = git_apply(p, tree, check_only)
                    if r.returncode:
                        failed = True
                        print(f"FAIL {p.name} ({label}, {'check' if check_only else 'apply'}): {r.stderr.strip()}")
                        break
                else:
                    print(f"ok   {p.name} applies ({label})")
            if args.exactness and registry.get(optimization_of(p)).equivalence == "exact":
                ok, msg = check_exact(p, work)
                failed |= not ok
                print(f"{'ok  ' if ok else 'FAIL'} {p.name} exact vs plugin: {msg}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    raise SystemExit(main())
