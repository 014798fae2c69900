"""From raw measurements to the figures verdicts are made of: per-round times, savings, noise floor, labels and the
control stages that flag *process bias* (docs/ablation.md, "Verdicts and exit codes", "How verdicts are made")."""

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
from vllm_omni_ascend_opt.optimization import STAGES, weakest_tier

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
    """Two-sided p of the exact Wilcoxon signed-rank test (mid-ranks for ties, zeros dropped) of savings about zero:
    every sign assignment is counted, so the false-alarm rate holds at any number of rounds."""
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
    """|mean of a - b| + two standard errors over rounds (default: the two identical full stacks)."""
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
            cur.update({k: max(v, int(m[k])) for k, v in cur.items()})
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


#: The label of a comparison whose control stages differ beyond their noise floor (inconclusive).
BIAS = "process bias"
TOTAL = "total"


def _basis(means: Means, stages: tuple[str, ...] | list[str]) -> tuple[str, ...]:
    """``stages``, or ``("total",)`` when they are every stage or some round lacks one (an engine without stages)."""
    st = tuple(x for x in STAGES if x in stages)
    if not st or set(st) == set(STAGES):
        return (TOTAL,)
    if all(x in row for rows in means.values() for row in rows.values() for x in st):
        return st
    return (TOTAL,)


def _on(means: Means, basis: tuple[str, ...]) -> Means:
    """``means`` with each round's ``total`` replaced by the sum of ``basis``."""
    if basis == (TOTAL,):
        return means
    return {
        cid: {r: {TOTAL: sum(row[x] for x in basis)} for r, row in rows.items() if all(x in row for x in basis)}
        for cid, rows in means.items()
    }


#: Per stage, the pairs of configurations ``(without, with_)`` that nothing compared between them changes there.
Nulls = dict[str, list[tuple[str, str]]]


def _measured(
    means: Means, basis: tuple[str, ...], without: str, with_: str, nulls: Nulls | None = None
) -> tuple[dict[str, Any], float | None, str]:
    """:func:`pair`, noise floor and label of a comparison on ``basis``; the floor is the largest over the identical
    full stacks and every other pair null on all of ``basis`` (``nulls``)."""
    on = _on(means, basis)
    p = pair(on, without, with_)
    pairs = [("full_ctrl", "full")]
    if nulls is not None and basis != (TOTAL,):
        shared = set.intersection(*(set(nulls.get(x, ())) for x in basis))
        pairs += sorted(pr for pr in shared if pr != (without, with_))
    floors = [nf["ms"] for nf in (noise_floor(on, a, b) for a, b in pairs) if nf]
    noise_ms = max(floors) if floors else None
    return p, noise_ms, label(p["per_round_ms"], p["mean_ms"], noise_ms)


def staged(
    means: Means,
    without: str,
    with_: str,
    stages: tuple[str, ...] | list[str],
    nulls: Nulls | None = None,
) -> dict[str, Any]:
    """``basis``, ``saved`` (:func:`pair` on it), ``noise_ms``, ``p_raw`` and ``p`` (its own signed-rank p), its own
    ``label`` and ``control`` (None on the total)."""
    basis = _basis(means, stages)
    p_s, noise_ms, _ = _measured(means, basis, without, with_, nulls)
    raw = signed_rank_p(p_s["per_round_ms"]) if p_s["per_round_ms"] else None
    control, control_p = None, None
    rest = tuple(x for x in STAGES if x not in basis)
    if basis != (TOTAL,) and rest:
        cp, c_noise, c_lab = _measured(means, rest, without, with_, nulls)
        control_p = signed_rank_p(cp["per_round_ms"]) if cp["per_round_ms"] else None
        control = {
            "stages": list(rest),
            "diff_ms": cp["mean_ms"],
            "per_round_ms": cp["per_round_ms"],
            "noise_ms": c_noise,
            "bias": c_lab in (GAIN, REGRESSION),
        }
    st = {"basis": list(basis), "saved": p_s, "noise_ms": noise_ms, "p_raw": raw, "control": control}
    return {**st, "control_p": control_p, "p": raw, "label": judged(st)}


def judged(
    st: dict[str, Any], p: float | None = None, family: int = 1, control_p: float | None = None, controls: int = 1
) -> str:
    """The label of a :func:`staged` comparison with ``p`` (None: its own test) over ``family`` comparisons; with
    ``control_p`` (its control's p corrected over ``controls`` checks) the control's bias is decided again first."""
    c = st["control"]
    if c is not None and control_p is not None:
        c["bias"] = label(c["per_round_ms"], c["diff_ms"], c["noise_ms"], control_p, controls) in (GAIN, REGRESSION)
    s = st["saved"]
    lab = label(s["per_round_ms"], s["mean_ms"], st["noise_ms"], p, family)
    return BIAS if st["control"] and st["control"]["bias"] and lab != "not measured" else lab


def bias_text(what: str, entry: dict[str, Any]) -> str:
    """The sentence that names a comparison's process bias (``entry``: its entry in the analysis)."""
    c = entry["control"]
    return (
        f"process bias in {what}: the control stages ({', '.join(c['stages'])}), which nothing compared there "
        f"changes, differ by {c['diff_ms']:+.2f} ms between the two processes, beyond their noise floor "
        f"{c['noise_ms']:.2f} ms; inconclusive (on {'+'.join(entry['stages'])}: {fmt_saved(entry)})"
    )


def staged_fields(
    st: dict[str, Any], total: dict[str, Any], total_pct: float | None, stock_ms: float | None
) -> dict[str, Any]:
    """A comparison's entry in results.json: the saving on its stages (what label and verdict use) and on the total."""
    s = st["saved"]
    pct = 100 * s["mean_ms"] / stock_ms if s["mean_ms"] is not None and stock_ms else None
    return {
        "stages": st["basis"],
        "saved_ms": {"mean": s["mean_ms"], "std": s["std_ms"], "per_round": s["per_round_ms"]},
        "saved_pct_of_stock": pct,
        "noise_floor_ms": st["noise_ms"],
        "total_saved_ms": {"mean": total["mean_ms"], "std": total["std_ms"], "per_round": total["per_round_ms"]},
        "total_saved_pct_of_stock": total_pct,
        "stages_saved_ms": total["stages_mean_ms"],
        "control": st["control"],
        "direction": direction(s["per_round_ms"]),
        "p_value": st["p"],
        "p_raw": st["p_raw"],
    }


def fmt_saved(d: dict[str, Any], *, stages: bool = False) -> str:
    """``+x ± y ms (+z%)``, and with ``stages`` the stages it was measured on (``on denoise+vae_decode``)."""
    s = d["saved_ms"]
    if s["mean"] is None:
        return "not measured"
    pct = d.get("saved_pct_of_stock")
    pct_s = f" ({pct:+.2f}%)" if pct is not None and not math.isnan(pct) else ""
    on = f" on {'+'.join(d.get('stages') or [TOTAL])}" if stages else ""
    pv = d.get("p_value")
    return f"{s['mean']:+.2f} ± {s['std']:.2f} ms{pct_s}{on}" + (f", p = {pv:.2g}" if pv is not None and stages else "")
