"""From raw measurements to the figures verdicts are made of: a configuration's time per complete round
(``round_stat`` over its samples), time saved per round (``time(without) - time(with)``), the noise floor and the
labels, as defined in docs/ablation.md ("Verdicts and exit codes").
"""

from __future__ import annotations

import itertools
import math
import os
import statistics
from functools import lru_cache
from pathlib import Path
from typing import Any

from vllm_omni_ascend_opt.ablation import compare
from vllm_omni_ascend_opt.ablation.plan import Plan
from vllm_omni_ascend_opt.ablation.protocol import STAGES
from vllm_omni_ascend_opt.optimization import weakest_tier

PASS, FAIL, INCONCLUSIVE = "PASS", "FAIL", "INCONCLUSIVE"
EXIT_CODES = {PASS: 0, FAIL: 1, INCONCLUSIVE: 2}
GAIN, REGRESSION, NOISE = "gain", "regression", "within noise"
#: The family-wise false-alarm level of a run's optimization verdicts (Holm), and the full stack's own level.
ALPHA = 0.05
TEST = "exact two-sided Wilcoxon signed-rank test over rounds"
#: configuration -> round -> {"total": ms, <stage>: ms}: what :func:`round_means` returns.
Means = dict[str, dict[int, dict[str, float]]]


def round_means(plan: Plan, records: list[dict[str, Any]]) -> Means:
    """config -> round -> {"total": ms, <stage>: ms} over each complete round's samples (``round_stat``)."""
    samples = set(plan.samples)
    agg = {"median": statistics.median, "mean": statistics.fmean, "min": min}[plan.workload.round_stat]
    acc: dict[tuple[str, int], dict[tuple[int, int], dict[str, Any]]] = {}
    for r in records:
        if r.get("type") == "sample" and not r.get("warmup"):
            acc.setdefault((r["config"], r["round"]), {})[(r["prompt"], r["seed"])] = r
    out: Means = {}
    for (cid, rnd), got in acc.items():
        if set(got) != samples:
            continue
        vals = list(got.values())
        row = {"total": agg([v["total_ms"] for v in vals])}
        for st in STAGES:
            xs = [v["stages_ms"][st] for v in vals if st in (v.get("stages_ms") or {})]
            if len(xs) == len(vals):
                row[st] = agg(xs)
        out.setdefault(cid, {})[rnd] = row
    return out


def _std(xs: list[float]) -> float:
    """Sample standard deviation (floats: the simulation of verdicts calls it thousands of times)."""
    if len(xs) < 2:
        return 0.0
    m = math.fsum(xs) / len(xs)
    return math.sqrt(math.fsum((x - m) ** 2 for x in xs) / (len(xs) - 1))


def pair(means: Means, without: str, with_: str) -> dict[str, Any]:
    """Time saved by going from ``without`` to ``with_``, per round and summarised."""
    a, b = means.get(without, {}), means.get(with_, {})
    rounds = sorted(set(a) & set(b))
    per = [a[r]["total"] - b[r]["total"] for r in rounds]
    stages = {}
    for st in STAGES:
        if all(st in a[r] and st in b[r] for r in rounds) and rounds:
            stages[st] = statistics.fmean(a[r][st] - b[r][st] for r in rounds)
    return {
        "rounds": rounds,
        "per_round_ms": per,
        "mean_ms": statistics.fmean(per) if per else None,
        "std_ms": _std(per) if per else None,
        "stages_mean_ms": stages,
    }


def direction(per_round: list[float]) -> str:
    if not per_round:
        return "n/a"
    if all(x > 0 for x in per_round) or all(x < 0 for x in per_round):
        return "consistent"
    return "flips"


def standard_error(per_round: list[float]) -> float | None:
    """Standard error of the mean over rounds (None with fewer than two rounds)."""
    return _std(per_round) / math.sqrt(len(per_round)) if len(per_round) > 1 else None


@lru_cache(maxsize=256)
def _null_cdf(scores: tuple[int, ...]) -> tuple[int, ...]:
    """How many of the 2^n sign assignments of ``scores`` give a sum of the positive ones <= t, for t = 0..sum."""
    counts = [1] + [0] * sum(scores)
    for sc in scores:
        counts = [c + (counts[t - sc] if t >= sc else 0) for t, c in enumerate(counts)]
    return tuple(itertools.accumulate(counts))


def signed_rank_p(per_round: list[float]) -> float:
    """Two-sided p of the exact Wilcoxon signed-rank test that the savings are symmetric about zero.

    Ranks of |saving| (mid-ranks for ties, zero savings dropped); the null distribution is every sign assignment,
    counted exactly, so the false-alarm rate holds at any number of rounds."""
    xs = [x for x in per_round if x != 0]
    if not xs:
        return 1.0
    order = sorted(range(len(xs)), key=lambda i: abs(xs[i]))
    scores = [0] * len(xs)  # twice the mid-rank: integers
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and abs(xs[order[j + 1]]) == abs(xs[order[i]]):
            j += 1
        for k in range(i, j + 1):
            scores[order[k]] = i + j + 2
        i = j + 1
    total = sum(scores)
    obs = abs(2 * sum(sc for sc, x in zip(scores, xs, strict=True) if x > 0) - total)
    if obs == 0:
        return 1.0
    # the null distribution is symmetric: P(|2T - total| >= obs) = 2 P(T <= (total - obs) / 2)
    cdf = _null_cdf(tuple(sorted(scores)))
    return min(1.0, 2 * cdf[(total - obs) // 2] / 2 ** len(xs)) if obs <= total else 0.0


def holm(ps: list[float | None]) -> list[float | None]:
    """Holm–Bonferroni adjusted p-values (None stays None and does not count as a comparison)."""
    idx = sorted((i for i, p in enumerate(ps) if p is not None), key=lambda i: ps[i])  # type: ignore[arg-type,return-value]
    out: list[float | None] = [None] * len(ps)
    running = 0.0
    for k, i in enumerate(idx):
        running = max(running, min(1.0, (len(idx) - k) * ps[i]))  # type: ignore[operator]
        out[i] = running
    return out


def testable(rounds: int, family: int = 1, alpha: float = ALPHA) -> bool:
    """Whether the signed-rank test over ``rounds`` can reach ``alpha`` over ``family`` comparisons at all."""
    return rounds > 0 and family * 2.0 / 2**rounds <= alpha


def label(
    per_round: list[float], mean: float | None, noise_ms: float | None, p: float | None = None, family: int = 1
) -> str:
    """gain / regression: beyond the noise floor and significant (``p``, default the saving's own signed-rank test,
    <= :data:`ALPHA`); else within noise. Rounds too few for the test to reach the level over ``family``
    comparisons: beyond the floor and two standard errors (one round: the floor)."""
    if mean is None or not per_round:
        return "not measured"
    if noise_ms is None:
        return "no noise floor"
    if testable(len(per_round), family):
        sig = (signed_rank_p(per_round) if p is None else p) <= ALPHA
        up = down = sig
    else:
        se = standard_error(per_round) or 0.0
        up, down = mean - 2 * se > 0, mean + 2 * se < 0
    if mean > noise_ms and up:
        return GAIN
    if mean < -noise_ms and down:
        return REGRESSION
    return NOISE


def noise_floor(means: Means, a: str = "full_ctrl", b: str = "full") -> dict[str, Any] | None:
    """|mean of a - b| + two standard errors over rounds (one round: that round's |difference|): by default the two
    identical full stacks."""
    p = pair(means, a, b)
    per = p["per_round_ms"]
    if not per:
        return None
    se = standard_error(per)
    return {
        "ms": abs(statistics.fmean(per)) + 2 * (se or 0.0),
        "mean_diff_ms": statistics.fmean(per),
        "se_ms": se,
        "per_round_ms": per,
        "configs": [b, a],
    }


def machine_load(records: list[dict[str, Any]], cpu_count: int | None = None) -> dict[str, Any]:
    """``busy``: the median ``others_cpu`` exceeds the cores the worker left free by a quarter (at least half) core."""
    cpus = cpu_count or os.cpu_count() or 1
    meas = [r for r in records if r.get("type") == "sample" and not r.get("warmup")]
    loads = [r["load1"] for r in meas if r.get("load1") is not None]
    others = [r["others_cpu"] for r in meas if r.get("others_cpu") is not None]
    ratios = [r["total_ms"] / r["cpu_ms"] for r in meas if r.get("cpu_ms")]
    threads = [
        (r.get("env") or {}).get("device", {}).get("torch_threads")
        for r in records
        if r.get("type") == "ready" and r.get("env")
    ]
    threads = [t for t in threads if isinstance(t, int) and t > 0]
    free = max(0.5, cpus - (max(threads) if threads else cpus) + 0.25)
    other_median = statistics.median(others) if others else None
    return {
        "cpu_count": cpus,
        "load1_max": max(loads) if loads else None,
        "load1_median": statistics.median(loads) if loads else None,
        "others_cpu_median": other_median,
        "others_cpu_threshold": free,
        "wall_over_cpu_median": statistics.median(ratios) if ratios else None,
        "busy": other_median is not None and other_median > free,
    }


def compare_samples(plan: Plan, root: Path, ref: str, other: str) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """Each sample's stored image of ``other`` against ``ref`` (:func:`~.compare.compare`), and the samples missing."""
    per: dict[str, dict[str, Any]] = {}
    missing = []
    for p, s in plan.samples:
        key = f"p{p}_s{s}"
        try:
            a = compare.load_stored(root / "images" / ref / key)
            b = compare.load_stored(root / "images" / other / key)
        except FileNotFoundError:
            missing.append(key)
            continue
        per[key] = compare.compare(a, b)
    return per, missing


def compare_configs(plan: Plan, out_root: Any, ref: str, other: str) -> dict[str, Any]:
    """``other`` against ``ref`` per sample, the worst case, and the gate of the weakest tier the two differ by."""
    root = Path(out_root)
    diff = plan.diff(ref, other)
    equivalence = weakest_tier([plan.opts[n].equivalence for n in diff])  # exact < pixel < close
    per, missing = compare_samples(plan, root, ref, other)
    agg = compare.aggregate(per) if not missing else {}
    gates = plan.close_gates(diff)
    return {
        "reference": ref,
        "class": equivalence,
        "gates": gates,
        "per_sample": per,
        "worst": agg,
        "gate": compare.gate(agg, equivalence, gates["ssim"], gates["psnr_db"]),
        "missing": missing,
    }


def peak_memory(ready: list[dict[str, Any]]) -> dict[str, Any] | None:
    """A configuration's largest peak and end bytes per measured call over its workers; None: none measured."""
    out: dict[str, Any] = {}
    errors = []
    for r in ready:
        mem = r.get("memory")
        if not isinstance(mem, dict):
            continue
        if "error" in mem:
            errors.append(str(mem["error"]))
            continue
        for label, m in mem.items():
            cur = out.setdefault(label, {"peak": 0, "end": 0})
            cur["peak"] = max(cur["peak"], int(m["peak"]))
            cur["end"] = max(cur["end"], int(m["end"]))
    if errors and not out:
        return {"error": errors[-1]}
    return out or None


def add_memory_ratios(configs: list[dict[str, Any]]) -> None:
    """``memory[label]["vs_stock"]``: each configuration's peak over stock's, measured in the same run."""
    stock = next((c.get("memory") for c in configs if c["id"] == "stock"), None) or {}
    for c in configs:
        for label, m in (c.get("memory") or {}).items():
            if label == "error":
                continue
            base = (stock.get(label) or {}).get("peak")
            m["vs_stock"] = m["peak"] / base if base else None
