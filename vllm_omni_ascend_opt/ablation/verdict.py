"""A run's analysis and verdict: :func:`analyse` (the ``analysis`` part of results.json) and :func:`decide` (PASS,
FAIL or INCONCLUSIVE: docs/ablation.md, "Verdicts and exit codes"); :func:`vs_unquantized`, the information a run
measures but never judges (docs/ablation.md, "Information: quantized against unquantized stock").
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from vllm_omni_ascend_opt.ablation import compare, stats
from vllm_omni_ascend_opt.ablation.plan import INFORMATION, QUANTIZATION_KEY, Plan
from vllm_omni_ascend_opt.optimization import STAGES

#: The configuration the information compares with the unquantized one: the quantized stock of every verdict.
QUANTIZED = "stock"


def timings(plan: Plan, means: stats.Means, failed: Any = ()) -> dict[str, Any]:
    """The timing verdicts of a run from its round means: ``optimizations`` (one per comparison, Holm-corrected
    together), ``full_vs_stock`` (its own test), ``noise_floor``, ``stock_ms`` and ``significance``."""
    noise = stats.noise_floor(means)

    def mean_total(cid: str) -> float | None:
        rows = means.get(cid, {})
        return statistics.fmean(v["total"] for v in rows.values()) if rows else None

    stock_ms = mean_total("stock")
    # per stage, the compared pairs whose optimizations do not act there: more process pairs for its noise floor
    nulls: stats.Nulls = {}
    for c in plan.comparisons:
        acts = set(plan.stages_of(plan.diff(c.with_, c.without)))
        for x in STAGES:
            if x not in acts:
                nulls.setdefault(x, []).append((c.without, c.with_))
    if noise is not None:
        noise["pct"] = 100 * noise["ms"] / stock_ms if stock_ms else None

    def compared(without: str, with_: str, names: Any) -> tuple[dict[str, Any], dict[str, Any]]:
        """The staged comparison of two configurations that differ by ``names`` (its own test), and its fields."""
        p = stats.pair(means, without, with_)
        base = stock_ms or mean_total(without)
        pct = 100 * p["mean_ms"] / base if p["mean_ms"] is not None and base else None
        st = stats.staged(means, without, with_, plan.stages_of(names), nulls=nulls)
        return st, {**stats.staged_fields(st, p, pct, stock_ms), "label": st["label"]}

    # the optimizations' verdicts are one family: their signed-rank p-values are corrected together (Holm)
    usable = [c.with_ not in failed and c.without not in failed for c in plan.comparisons]
    # the two sides differ by comp.opt alone, or also by the optimizations that need it (leave-one-out)
    done = [compared(c.without, c.with_, plan.diff(c.with_, c.without)) for c in plan.comparisons]
    adjusted = stats.holm([st["p_raw"] if ok else None for (st, _), ok in zip(done, usable, strict=True)])
    family = sum(p is not None for p in adjusted)
    # so are their process-bias checks: a control flagged by chance makes a true effect inconclusive
    ctrl = stats.holm([st["control_p"] if ok else None for (st, _), ok in zip(done, usable, strict=True)])
    controls = sum(p is not None for p in ctrl)
    opts = []
    for comp, (st, fields), ok, pv, cpv in zip(plan.comparisons, done, usable, adjusted, ctrl, strict=True):
        opts.append(
            {
                "name": comp.opt,
                "equivalence": plan.opts[comp.opt].equivalence,
                "with": comp.with_,
                "without": comp.without,
                **fields,
                "p_value": pv,
                "label": stats.judged(st, pv, family, cpv, controls) if ok else "not measured",
            }
        )
    fvs = None
    if "full" in {c.id for c in plan.configs}:
        _, full_vs = compared("stock", "full", plan.diff("stock", "full"))
        fvs = {**full_vs, "stock_ms": stock_ms, "full_ms": mean_total("full")}
    rounds = max((len(o["saved_ms"]["per_round"]) for o in opts), default=0)
    significance = {
        "test": stats.TEST,
        "family_wise_level": stats.ALPHA,
        "correction": "Holm",
        "family": family,
        "tested": stats.testable(rounds, family),
    }
    return {
        "optimizations": opts,
        "full_vs_stock": fvs,
        "noise_floor": noise,
        "stock_ms": stock_ms,
        "significance": significance,
    }


def analyse(plan: Plan, records: list[dict[str, Any]], out_root: Any, *, interrupted: bool = False) -> dict[str, Any]:
    """The ``analysis`` part of results.json (see docs/ablation.md)."""
    wl = plan.workload
    means = stats.round_means(plan, records)
    failures = {r["config"]: r for r in records if r.get("type") == "failure"}
    ready: dict[str, list[dict[str, Any]]] = {}
    shas: dict[str, dict[str, set[str]]] = {}
    for r in records:
        if r.get("type") == "ready":
            ready.setdefault(r["config"], []).append(r)
        elif r.get("type") == "sample" and r.get("sha256"):
            shas.setdefault(r["config"], {}).setdefault(f"p{r['prompt']}_s{r['seed']}", set()).add(r["sha256"])
    timed = timings(plan, means, failures)

    ids = {c.id for c in plan.configs}
    configs = []
    for c in plan.configs:
        rows = means.get(c.id, {})
        totals = [rows[r]["total"] for r in sorted(rows)]
        status = "failed" if c.id in failures else ("ok" if len(rows) == wl.repeats else "incomplete")
        entry: dict[str, Any] = {
            "id": c.id,
            "label": c.label,
            "role": c.role,
            "opts": list(c.opts),
            "spec": c.spec,
            "status": status,
            "error": failures[c.id]["error"] if c.id in failures else None,
            "rounds_complete": sorted(rows),
            "total_ms": {
                "mean": statistics.fmean(totals) if totals else None,
                "std": stats._std(totals) if totals else None,
                "per_round": totals,
            },
            "stages_ms": {
                st: statistics.fmean(rows[r][st] for r in rows)
                for st in STAGES
                if rows and all(st in rows[r] for r in rows)
            },
            "load_s": [x.get("load_s") for x in ready.get(c.id, [])],
            "pids": [x.get("pid") for x in ready.get(c.id, [])],
            "active_in_worker": (ready.get(c.id) or [{}])[-1].get("active"),
            "memory": stats.peak_memory(ready.get(c.id, [])),
            "outputs_stable_across_rounds": all(len(v) == 1 for v in shas.get(c.id, {}).values())
            if shas.get(c.id)
            else None,
            "images": {f"p{p}_s{s}": f"images/{c.id}/p{p}_s{s}.png" for p, s in plan.samples},
        }
        for ref, key in (("stock", "vs_stock"), ("full", "vs_full")):
            # an information configuration is not held to any tier (it runs other vLLM-Omni modes)
            usable = c.id != ref and ref in ids and status != "failed" and ref not in failures
            usable = usable and c.role != INFORMATION
            entry[key] = stats.compare_configs(plan, out_root, ref, c.id) if usable else None
        configs.append(entry)

    stats.add_memory_ratios(configs)
    opts = timed["optimizations"]
    for o in opts:
        ok = o["with"] not in failures and o["without"] not in failures
        o["equivalence_check"] = stats.compare_configs(plan, out_root, o["without"], o["with"]) if ok else None
    fvs, noise = timed["full_vs_stock"], timed["noise_floor"]
    load = stats.machine_load(records)
    verdict = decide(plan, configs, opts, fvs, noise, interrupted, load=load)
    unquantized = vs_unquantized(plan, means, out_root, failures)
    return {
        "verdict": verdict,
        "significance": timed["significance"],
        "measurement": {"round_stat": wl.round_stat, **load},
        "noise_floor": noise,
        "full_vs_stock": fvs,
        "optimizations": opts,
        "configs": configs,
        "information": {"vs_unquantized": unquantized} if unquantized else None,
    }


def decide(
    plan: Plan,
    configs: list[dict[str, Any]],
    opts: list[dict[str, Any]],
    fvs: dict[str, Any] | None,
    noise: dict[str, Any] | None,
    interrupted: bool = False,
    *,
    load: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Overall PASS / FAIL / INCONCLUSIVE with the reasons, and the exit code."""
    wl = plan.workload
    fail, unsure, slow = [], [], []
    for c in configs:
        if c.get("role") == INFORMATION:  # measured for information only: never a reason for the verdict
            continue
        if c["status"] == "failed":
            fail.append(f"configuration {c['id']} failed: {c['error']}")
        elif c["status"] == "incomplete":
            unsure.append(f"configuration {c['id']} is incomplete ({len(c['rounds_complete'])}/{wl.repeats} rounds)")
        for key in ("vs_stock", "vs_full"):
            chk = c.get(key)
            if chk and chk["gate"]["passed"] is False:
                fail.append(
                    f"{c['id']} {key.replace('_', ' ')}: {chk['gate']['class']} gate failed: {chk['gate']['why']}"
                )
    notes = []
    for o in opts:
        chk = o["equivalence_check"]
        if chk and chk["gate"]["passed"] is False:
            fail.append(f"{o['name']} ({o['equivalence']}): gate failed: {chk['gate']['why']}")
        if o["label"] == stats.REGRESSION:
            slow.append(f"{o['name']} is a regression: {stats.fmt_saved(o, stages=True)}")
        elif o["label"] == stats.BIAS:
            notes.append(stats.bias_text(f"{o['name']}'s comparison ({o['without']} vs {o['with']})", o))
    if noise is None:
        unsure.append("no noise floor (the control pair did not complete)")
    if interrupted:
        unsure.append("the run was interrupted")
    if fvs is None or fvs["saved_ms"]["mean"] is None:
        unsure.append("full stack vs stock not measured")
    else:
        lab, pct = fvs["label"], fvs["saved_pct_of_stock"]
        nf = fvs.get("noise_floor_ms")
        if lab == stats.REGRESSION:
            slow.append(f"the full stack is slower than stock: {stats.fmt_saved(fvs, stages=True)}")
        elif lab == stats.BIAS:
            unsure.append(stats.bias_text("full stack vs stock", fvs))
        elif lab == stats.GAIN and pct is not None and pct < wl.min_improvement_pct:
            slow.append(
                f"the full stack saves {pct:.2f}% of stock on {'+'.join(fvs.get('stages') or [stats.TOTAL])}, less "
                f"than --min-improvement-pct {wl.min_improvement_pct}%"
            )
        elif lab != stats.GAIN:
            unsure.append(
                f"full stack vs stock is {lab} ({stats.fmt_saved(fvs, stages=True)}, noise floor {nf:.2f} ms)"
                if nf is not None
                else f"full stack vs stock is {lab}"
            )
    if load and load.get("busy"):
        note = (
            f"the machine was busy while measuring (other processes kept {load['others_cpu_median']:.2f} of "
            f"{load['cpu_count']} CPUs busy, median): wall-clock differences are unreliable"
        )
        if slow:
            unsure.append(note + "; timing failures are reported as inconclusive: " + "; ".join(slow))
            slow = []
        elif fvs is None or fvs["label"] != stats.GAIN:
            unsure.append(note)
    fail += slow
    if fail:
        result, reasons = stats.FAIL, fail + unsure + notes
    elif unsure:
        result, reasons = stats.INCONCLUSIVE, unsure + notes
    else:
        result = stats.PASS
        nf = fvs.get("noise_floor_ms", noise["ms"])
        reasons = [
            f"every gate held; the full stack saves {stats.fmt_saved(fvs, stages=True)} vs stock "
            f"(>= {wl.min_improvement_pct}%, beyond the noise floor {nf:.2f} ms)",
            *notes,
        ]
    return {"result": result, "exit_code": stats.EXIT_CODES[result], "reasons": reasons}


def vs_unquantized(
    plan: Plan, means: stats.Means, out_root: Any, failures: dict[str, Any] | set[str]
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
    per_s, missing = stats.compare_samples(plan, Path(out_root), ref.id, QUANTIZED)
    out["image"] = {"per_sample": per_s, "worst": compare.aggregate(per_s), "missing": missing}
    # the quantization's saving per round: time unquantized - time quantized, on the whole request
    p = stats.pair(means, ref.id, QUANTIZED)
    per = p["per_round_ms"]
    if not per:
        out["status"] = "not measured: no round complete in both configurations"
        return out
    noise_ms = (stats.noise_floor(means) or {}).get("ms")
    ref_ms = statistics.fmean(means[ref.id][r]["total"] for r in p["rounds"])
    out["time"] = {
        "stages": ["total"],
        "saved_ms": {"mean": p["mean_ms"], "std": p["std_ms"], "per_round": per},
        "se_ms": stats.standard_error(per),
        "saved_pct_of_unquantized": 100 * p["mean_ms"] / ref_ms if ref_ms else None,
        "stages_saved_ms": p["stages_mean_ms"],
        "unquantized_ms": ref_ms,
        "quantized_ms": statistics.fmean(means[QUANTIZED][r]["total"] for r in p["rounds"]),
        "noise_floor_ms": noise_ms,
        "direction": stats.direction(per),
        "p_value": stats.signed_rank_p(per),
        "tested": stats.testable(len(per)),  # False: too few rounds for the test, the label uses two standard errors
        "label": stats.label(per, p["mean_ms"], noise_ms),
    }
    return out
