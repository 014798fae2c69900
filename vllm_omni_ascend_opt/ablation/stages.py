"""Stage-aware comparisons: on the stages the optimizations can change, the other stages as a control whose
difference beyond its noise floor is *process bias* (docs/ablation.md, "How verdicts are made").
"""

from __future__ import annotations

import math
from typing import Any

from vllm_omni_ascend_opt.ablation.protocol import STAGES
from vllm_omni_ascend_opt.ablation.stats import (
    GAIN,
    REGRESSION,
    Means,
    direction,
    label,
    noise_floor,
    pair,
    signed_rank_p,
)

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
    """:func:`pair`, the noise floor and the label (its own test) of a comparison on ``basis``. The floor is the
    largest over the identical full stacks and every other pair that is null on all of ``basis`` (``nulls``): one
    pair of processes says little of how far two processes' speeds can differ on a stage."""
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
    p: float | None = None,
    family: int = 1,
    nulls: Nulls | None = None,
) -> dict[str, Any]:
    """``basis``, ``saved`` (:func:`pair` on it), ``noise_ms``, ``p_raw`` (its own signed-rank p), ``p`` (``p`` when
    given, corrected over ``family`` comparisons, else ``p_raw``), ``label`` and ``control`` (None on the total)."""
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
    return {**st, "control_p": control_p, "p": raw if p is None else p, "label": judged(st, p, family)}


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
