"""Four test-only optimizations that change nothing, and the recorder of the null fixture they make possible.

``--import tests.ablation_null_run --only null_a,null_b,null_c,null_d``: a real ``tiny-cpu`` run in which every
configuration runs the same code (three declare denoise, one the VAE decode, as the default stack's do); its stage
times are the noise tests/test_ablation_significance.py replays.

    python -m tests.ablation_null_run --out DIR --repeats 24     # records tests/fixtures/ablation_null_rounds.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from vllm_omni_ascend_opt.optimization import Optimization
from vllm_omni_ascend_opt.registry import register_optimization

PIPELINE = "vllm_omni.diffusion.models.qwen_image.pipeline_qwen_image"
FIXTURE = Path(__file__).parent / "fixtures" / "ablation_null_rounds.json"
NAMES = ("null_a", "null_b", "null_c", "null_d")


class _Null(Optimization):
    target_modules = (PIPELINE,)
    default_enabled = False
    equivalence = "exact"
    summary = "test only: changes nothing"
    no_patch_reason = "test only"

    def _attach(self, model: Any) -> None:
        setattr(model, f"_{self.name}", True)

    def _detach(self, model: Any) -> None:
        model.__dict__.pop(f"_{self.name}", None)


def _make(name: str, stage: str) -> Optimization:
    cls = type(f"Null_{name}", (_Null,), {"name": name, "stages": frozenset({stage})})
    return register_optimization(cls())


NULLS = [_make(n, "vae_decode" if n == "null_d" else "denoise") for n in NAMES]


def fixture_from(out: Path) -> dict[str, Any]:
    """The measured samples of a finished run in ``out``: what the fixture holds."""
    records = [json.loads(line) for line in (out / "measurements.jsonl").read_text().splitlines() if line.strip()]
    plan = json.loads((out / "plan.json").read_text())
    samples = [
        {k: r[k] for k in ("config", "round", "prompt", "seed", "total_ms", "stages_ms", "others_cpu", "load1")}
        for r in records
        if r.get("type") == "sample" and not r.get("warmup")
    ]
    wl = plan.get("workload", {})
    return {
        "what": "per-sample times of an ablation run whose configurations all run the same code (tests/ablation_null_run.py)",
        "workload": {
            k: wl.get(k) for k in "model steps cfg_scale seeds repeats process_sets threads vae_decode_repeats".split()
        },
        "configs": [c["id"] for c in plan["configs"]],
        "stages": {n: ["vae_decode" if n == "null_d" else "denoise"] for n in NAMES},
        "cpu_count": os.cpu_count(),
        "samples": samples,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="ablation-out/null")
    ap.add_argument("--repeats", type=int, default=24)
    ap.add_argument("--fixture", default=str(FIXTURE))
    ap.add_argument("--reuse", action="store_true", help="only convert the run already in --out")
    a = ap.parse_args()
    out = Path(a.out)
    if not a.reuse:
        cmd = [
            sys.executable, "-m", "vllm_omni_ascend_opt.cli", "ablate", "--workload", "tiny-cpu", "--import",
            "tests.ablation_null_run", "--only", ",".join(NAMES), "--repeats", str(a.repeats), "--out", str(out),
            "--fresh",
        ]  # fmt: skip
        subprocess.run(cmd, check=False)
    Path(a.fixture).write_text(json.dumps(fixture_from(out), separators=(",", ":")) + "\n")
    print(f"wrote {a.fixture}")


if __name__ == "__main__":
    main()
