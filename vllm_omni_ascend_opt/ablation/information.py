"""Information a run measures but never judges: with ``vs_unquantized``, the workload's quantized stock (vLLM-Omni's
int8) against stock without the quantization (docs/ablation.md, "Information: quantized against unquantized stock").

The plugin's tiers and gates stay relative to the same quantization: every verdict compares configurations that
all run it. What the quantization itself costs in image quality and saves in time is a different question, asked
by whoever chooses it; it is answered here with the run's own statistics (per-round saving, its standard error, the
signed-rank p on its own, not in the optimizations' family, the noise floor) and SSIM/PSNR per image. It is in its
own part of report.md and results.json (``information``) and cannot change the verdict or the exit code.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from vllm_omni_ascend_opt.ablation import compare
from vllm_omni_ascend_opt.ablation.plan import INFORMATION, QUANTIZATION_KEY, Plan
from vllm_omni_ascend_opt.ablation.stats import (
    Means,
    compare_samples,
    direction,
    label,
    noise_floor,
    pair,
    signed_rank_p,
    standard_error,
    testable,
)

#: The configuration the information compares with the unquantized one: the quantized stock of every verdict.
QUANTIZED = "stock"


def vs_unquantized(
    plan: Plan, means: Means, out_root: Any, failures: dict[str, Any] | set[str]
) -> dict[str, Any] | None:
    """The quantized stock against the unquantized one (time saved by the quantization, images against the
    unquantized ones); None when the plan has no information configuration."""
    ref = next((c for c in plan.configs if c.role == INFORMATION and QUANTIZATION_KEY in c.od_drop), None)
    if ref is None:
        return None
    out: dict[str, Any] = {
        "reference": ref.id,
        "config": QUANTIZED,
        "quantization": plan.workload.od_config.get(QUANTIZATION_KEY),
        "in_verdict": False,
        "status": "ok",
        "time": None,
        "image": None,
    }
    down = [c for c in (ref.id, QUANTIZED) if c in failures]
    if down:
        out["status"] = f"not measured: configuration {', '.join(down)} failed"
        return out
    out["time"] = _time(means, ref.id)
    out["image"] = _images(plan, Path(out_root), ref.id)
    if out["time"] is None:
        out["status"] = "not measured: no round complete in both configurations"
    return out


def _time(means: Means, ref: str) -> dict[str, Any] | None:
    """The quantization's saving per round (time unquantized - time quantized, on the whole request)."""
    p = pair(means, ref, QUANTIZED)
    per = p["per_round_ms"]
    if not per:
        return None
    nf = noise_floor(means)
    noise_ms = nf["ms"] if nf else None
    ref_ms = statistics.fmean(means[ref][r]["total"] for r in p["rounds"])
    q_ms = statistics.fmean(means[QUANTIZED][r]["total"] for r in p["rounds"])
    return {
        "stages": ["total"],
        "saved_ms": {"mean": p["mean_ms"], "std": p["std_ms"], "per_round": per},
        "se_ms": standard_error(per),
        "saved_pct_of_unquantized": 100 * p["mean_ms"] / ref_ms if ref_ms else None,
        "stages_saved_ms": p["stages_mean_ms"],
        "unquantized_ms": ref_ms,
        "quantized_ms": q_ms,
        "noise_floor_ms": noise_ms,
        "direction": direction(per),
        "p_value": signed_rank_p(per),
        "tested": testable(len(per)),  # False: too few rounds for the test, the label uses two standard errors
        "label": label(per, p["mean_ms"], noise_ms),
    }


def _images(plan: Plan, root: Path, ref: str) -> dict[str, Any]:
    """Every sample of the quantized stock against the unquantized one (the project's metrics), and the worst."""
    per, missing = compare_samples(plan, root, ref, QUANTIZED)
    return {"per_sample": per, "worst": compare.aggregate(per), "missing": missing}


def summary(info: dict[str, Any] | None) -> str | None:
    """The information as one line of the CLI summary (None without one)."""
    if not info:
        return None
    head = f"information (not in the verdict): {info['quantization']} {info['config']} vs {info['reference']}: "
    if info["status"] != "ok":
        return head + info["status"]
    t, w = info["time"], info["image"]["worst"]
    pct = "" if t["saved_pct_of_unquantized"] is None else f" ({t['saved_pct_of_unquantized']:+.2f}%)"
    img = (
        f"SSIM min {w['ssim_min']:.4f}, PSNR min {compare.fmt_db(w['psnr_db_min'])}"
        if w
        else "images missing: " + ", ".join(info["image"]["missing"])
    )
    saved = f"{t['saved_ms']['mean']:+.2f} ± {t['saved_ms']['std']:.2f} ms{pct}"
    return f"{head}saves {saved}, p = {t['p_value']:.2g}, {t['label']}; {img}"
