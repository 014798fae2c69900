"""The three reports of a run, in ``--out``: ``results.json`` (schema: docs/ablation.md and
:data:`vllm_omni_ascend_opt.ablation.schema.RESULTS_SCHEMA`), ``report.md`` and ``ablation.png``."""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from vllm_omni_ascend_opt.ablation.compare import fmt_db
from vllm_omni_ascend_opt.ablation.plan import INFORMATION
from vllm_omni_ascend_opt.ablation.schema import RESULTS_SCHEMA
from vllm_omni_ascend_opt.optimization import STAGES

SCHEMA_VERSION = 1
STAGE_TITLES = {"text_encode": "text encode", "denoise": "denoise", "vae_decode": "VAE decode"}


def build_results(data: Any, analysis: dict[str, Any], command: list[str] | None = None) -> dict[str, Any]:
    """Assemble results.json from the run data (:class:`~.runner.RunData`) and :func:`~.verdict.analyse`'s output."""
    from vllm_omni_ascend_opt import __version__

    plan = data.plan
    envs = [r for r in data.records if r.get("type") == "ready" and r.get("env")]
    env = dict(envs[0]["env"]) if envs else {}
    env.pop("flag", None)
    same = all({k: v for k, v in e["env"].items() if k != "flag"} == env for e in envs)

    def rows(kind: str) -> list[dict[str, Any]]:
        """The records of type ``kind`` with the fields results.json keeps of them."""
        return [{k: r.get(k) for k in RESULTS_SCHEMA[kind + "s"][0]} for r in data.records if r.get("type") == kind]

    wl = plan.workload
    return {
        "schema_version": SCHEMA_VERSION,
        "tool": {"name": "vllm-omni-ascend-opt", "version": __version__},
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": list(command or []),
        "verdict": analysis["verdict"],
        "significance": analysis["significance"],
        "workload": wl.to_dict(),
        "plan": plan.to_dict(),
        "environment": {**env, "same_in_every_worker": same, "workers": len(envs)},
        "gates": {"ssim": wl.ssim_gate, "psnr_db": wl.psnr_gate, "min_improvement_pct": wl.min_improvement_pct},
        **{k: analysis.get(k) for k in ("measurement", "noise_floor", "full_vs_stock", "optimizations", "configs")},
        "information": analysis.get("information"),
        "samples": rows("sample"),
        "failures": rows("failure"),
        "run": {
            "wall_s": data.wall_s,
            "resumed": data.resumed,
            "dropped_on_resume": data.dropped_on_resume,
            "interrupted": data.interrupted,
            "out_dir": str(data.out.root),
        },
    }


def jsonable(obj: Any) -> Any:
    """Replace non-finite floats (PSNR of identical images) by strings: "inf", "-inf", "nan"."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return "nan" if math.isnan(obj) else ("inf" if obj > 0 else "-inf")
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    return obj


def atomic_write(path: Path, content: str | Callable[[Path], Any]) -> Path:
    """``content`` (text, or a function that writes the path it is given) to ``path`` by way of a temporary file."""
    tmp = path.with_name(f"{path.stem}.tmp{os.getpid()}{path.suffix}")
    if callable(content):
        content(tmp)
    else:
        tmp.write_text(content, encoding="utf-8")
    os.replace(tmp, path)
    return path


def write_json(path: Path, obj: Any) -> Path:
    """``obj`` as JSON (non-finite floats as strings) to ``path``, atomically."""
    return atomic_write(path, json.dumps(jsonable(obj), indent=1, allow_nan=False))


def table_head(cols: list[str]) -> list[str]:
    """A markdown table's header and separator."""
    return ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]


def _table_head(first: str, last: str) -> list[str]:
    """A markdown table's header: the ``first`` columns, one per stage, then the ``last``."""
    return table_head([*first.split(" | "), *(f"{STAGE_TITLES[s]} ms" for s in STAGES), *last.split(" | ")])


def _num(v: float | None, spec: str = ".2f", unit: str = "") -> str:
    """``v`` in format ``spec`` with ``unit``; – for None."""
    return "–" if v is None else f"{v:{spec}}{unit}"


def _saved(d: dict[str, Any], key: str = "saved_ms") -> str:
    """``mean ± std`` of a comparison's ``saved_ms`` (or ``total_saved_ms``), signed."""
    s = d.get(key) or {}
    return "–" if s.get("mean") is None else f"{s['mean']:+.2f} ± {s['std']:.2f}"


def _on(d: dict[str, Any]) -> str:
    """The stages a comparison's saving and label are taken on."""
    return "+".join(d.get("stages") or ["total"])


def _control(d: dict[str, Any]) -> str:
    """The control stages' difference, ⚠ when it is process bias; – when there is no control."""
    c = d.get("control")
    if not c or c.get("diff_ms") is None:
        return "–"
    return f"{'⚠ ' if c['bias'] else ''}{c['diff_ms']:+.2f} (floor {_num(c['noise_ms'])})"


def comparison_rows(results: dict[str, Any]) -> list[tuple[str, str, dict[str, Any], dict[str, Any] | None]]:
    """``(name, class, comparison, equivalence check)`` per optimization, then the full stack vs stock (class "")."""
    rows = [(o["name"], o["equivalence"], o, o["equivalence_check"]) for o in results["optimizations"]]
    if results["full_vs_stock"]:
        full = next((c for c in results["configs"] if c["id"] == "full"), None)
        rows.append(("full stack vs stock", "", results["full_vs_stock"], full.get("vs_stock") if full else None))
    return rows


def gate_cell(chk: dict[str, Any] | None) -> str:
    """An equivalence check as a report cell: ✅ / ❌ and the worst pixel, SSIM or PSNR figures (also the CLI summary)."""
    if not chk:
        return "–"
    g = chk["gate"]
    mark = {True: "✅", False: "❌", None: "?"}[g["passed"]]
    w = chk.get("worst") or {}
    if not w:
        return f"{mark} {g['why']}"
    if g["class"] == "exact":
        extra = "" if w["pixel_identical"] else f", max |Δ| {w['max_abs_diff']:.3g}"
        return f"{mark} {'pixel-identical' if w['pixel_identical'] else 'differs'}{extra}"
    gates = chk.get("gates")
    limits = f" (gate ≥ {gates['ssim']} / ≥ {gates['psnr_db']} dB)" if gates else ""
    return f"{mark} SSIM {w['ssim_min']:.4f}, PSNR {fmt_db(w['psnr_db_min'])}{limits}"


def _significance(sig: dict[str, Any]) -> str:
    """The sentence that names the test, the correction and the family-wise level the labels were taken with."""
    if not sig:
        return ""
    level = f"{100 * sig['family_wise_level']:g}%"
    if not sig.get("tested"):
        return (
            f"*p*: the {sig['test']}. With this few rounds it cannot reach {level} over {sig['family']} "
            "comparison(s), so the labels use the noise floor and two standard errors: their false-alarm rate is "
            "not controlled (add rounds)."
        )
    return (
        f"*p*: the {sig['test']} on the per-round savings; the optimizations' p-values are {sig['correction']}-"
        f"corrected over the {sig['family']} compared here, at a family-wise level of {level}; the full stack vs "
        f"stock is its own test at {level}. Gain or regression = significant and beyond the noise floor."
    )


def markdown(results: dict[str, Any]) -> str:
    wl, plan, v = results["workload"], results["plan"], results["verdict"]
    env = results["environment"]
    dev = env.get("device") or {}
    lines = [
        f"# Ablation: {wl['name']} ({plan['workload']['mode']})",
        "",
        f"**Verdict: {v['result']}** (exit code {v['exit_code']})",
        "",
        *[f"- {r}" for r in v["reasons"]],
        "",
        "## Workload",
        "",
        "| model | engine | dtype | size | steps | CFG | prompts × seeds | warm-up | repeats | schedule |",
        "|---|---|---|---|---|---|---|---|---|---|",
        f"| {wl['model']} | {plan['engine']} | {wl['dtype']} | {wl['width']}×{wl['height']} | {wl['steps']} | "
        f"{wl['cfg_scale']} | {len(wl['prompts'])} × {wl['seeds']} | {wl['warmup']} | {wl['repeats']} | "
        f"{plan['schedule']} |",
        "",
        f"Device: {dev.get('type', '?')} ({dev.get('name', '?')}); torch {env.get('torch')}, torch_npu "
        f"{env.get('torch_npu') or 'not installed'}, vLLM {env.get('vllm')}, vLLM-Omni {env.get('vllm_omni')}, "
        f"vllm-omni-ascend-opt {env.get('vllm_omni_ascend_opt')}.",
        "",
    ]
    m = results.get("measurement") or {}
    if m:
        n = len(wl["prompts"]) * len(wl["seeds"])
        others = "unknown"
        if m.get("others_cpu_median") is not None:
            others = f"other processes kept {m['others_cpu_median']:.2f} of {m['cpu_count']} CPUs busy (median)"
        load = "" if m.get("load1_max") is None else f"; 1-min load average up to {m['load1_max']:.1f}"
        lines += [
            f"Each configuration's time in a round is the {m['round_stat']} over its {n} image(s). "
            f"Machine while measuring: {others}{load}.",
            "",
        ]
        if m.get("busy"):
            lines += [
                "> **Warning:** other work competed for the CPU while measuring; wall-clock differences are "
                "unreliable (timing failures are reported as inconclusive).",
                "",
            ]
    nf = results["noise_floor"]
    lines += ["## Time saved per optimization", ""]
    if nf:
        pct = f" ({nf['pct']:.2f}% of stock)" if nf.get("pct") is not None else ""
        lines.append(
            f"Noise floor (|mean of full − full_ctrl| + 2 standard errors over rounds): **{nf['ms']:.2f} ms**{pct}; "
            "full − full_ctrl per round: " + ", ".join(f"{x:+.2f}" for x in nf["per_round_ms"]) + " ms."
        )
    else:
        lines.append("Noise floor: **unknown** (the control pair did not complete).")
    lines += [
        "",
        *_table_head(
            "optimization | class | on stages | saved ms (mean ± std) | % of stock | per round (ms) | direction | "
            "label | p | total saved ms | control Δ ms",
            "equivalence",
        ),
    ]
    for name, cls, d, chk in comparison_rows(results):
        head = f"`{name}` | {cls}" if cls else f"**{name}** |"
        per = ", ".join(f"{x:+.1f}" for x in d["saved_ms"]["per_round"]) or "–"
        st = " | ".join(_num(d["stages_saved_ms"].get(s), "+.2f") for s in STAGES)
        lines.append(
            f"| {head} | {_on(d)} | {_saved(d)} | {_num(d['saved_pct_of_stock'], '+.2f', '%')} | {per} | {d['direction']} | "
            f"**{d['label']}** | {_num(d.get('p_value'), '.2g')} | {_saved(d, 'total_saved_ms')} | {_control(d)} | {st} | "
            f"{gate_cell(chk)} |"
        )
    lines += [
        "",
        "Saved = time without − time with the optimization (positive: faster), from the configurations named in "
        "the comparison, on the stages it can change (*on stages*; its label and the verdict use these, with the "
        "noise floor on the same stages); *total saved* is the same on the whole request. *Control Δ*: how much "
        "the other stages, which nothing compared changes, differ (⚠ beyond their noise floor: process bias, the "
        "comparison is inconclusive). docs/ablation.md in vllm-omni-ascend-opt explains how to read this report.",
        "",
        _significance(results.get("significance") or {}),
        *information_section((results.get("information") or {}).get("vs_unquantized"), results["gates"]),
        "",
        "## Configurations",
        "",
        *_table_head("configuration | optimizations | status | total ms (mean ± std)", "vs stock | vs full | stable"),
    ]
    for c in results["configs"]:
        t = c["total_ms"]
        tot = "–" if t["mean"] is None else f"{t['mean']:.2f} ± {t['std']:.2f}"
        st = " | ".join(_num(c["stages_ms"].get(s)) for s in STAGES)
        opts = ", ".join(c["opts"]) or "(none)"
        if c["role"] == INFORMATION:  # other vLLM-Omni modes than the rest: its label says which
            opts += f"; {c['label']}"
        stable = {True: "yes", False: "**no**", None: "–"}[c["outputs_stable_across_rounds"]]
        lines.append(
            f"| `{c['id']}` | {opts} | {c['status']} | {tot} | {st} | {gate_cell(c.get('vs_stock'))} | "
            f"{gate_cell(c.get('vs_full'))} | {stable} |"
        )
    lines += memory_section(results["configs"])
    lines += reference_section(results.get("reference"))
    if plan["skipped"]:
        lines += ["", "## Not in this run", "", "| optimization | why |", "|---|---|"]
        lines += [f"| `{n}` | {'; '.join(why)} |" for n, why in plan["skipped"].items()]
    if results["failures"]:
        lines += ["", "## Failures", ""]
        for f in results["failures"]:
            lines.append(
                f"- `{f['config']}` ({f['phase']}, round {f['round']}): {f['error']} — log: "
                f"`configs/{f['config']}/worker.log`"
            )
    run = results["run"]
    lines += [
        "",
        "## Files",
        "",
        "- `results.json`: every raw timing, metric, configuration and version (schema: docs/ablation.md)",
        "- `ablation.png`: time saved per optimization with std error bars and the noise band",
        "- `images/<configuration>/p<prompt>_s<seed>.png` (+ `.npy`: float output in [-1, 1])",
        "- `configs/<configuration>/worker.log`: each worker's log",
        "",
        f"Run wall time {run['wall_s']:.1f} s{' (resumed)' if run['resumed'] else ''}"
        f"{', interrupted' if run['interrupted'] else ''}.",
        "",
    ]
    return "\n".join(lines)


#: Measured calls of the memory table, in column order, with their titles.
MEMORY_CALLS = {"transformer_forward": "transformer forward", "vae_decode": "VAE decode"}


def information_section(info: dict[str, Any] | None, gates: dict[str, Any]) -> list[str]:
    """report.md's information section (empty without one): one row, outside the verdict."""
    if not info:
        return []
    q = info["quantization"]
    lines = [
        "",
        f"## Information: {q} stock vs stock without quantization (not in the verdict)",
        "",
        f"`{info['config']}` runs vLLM-Omni's `quantization_config={q!r}`, as every configuration above; "
        f"`{info['reference']}` is the same stock without it (the workload's other od_config fields kept), measured "
        "in the same rounds. The optimizations' tiers and the verdict stay judged against the quantized stock: this "
        "row only says what the quantization itself saves and costs, and cannot fail the run.",
        "",
    ]
    if info["status"] != "ok":
        return [*lines, f"Not measured: {info['status'].removeprefix('not measured: ')}."]
    t, im = info["time"], info["image"]
    w = im["worst"]
    lines += _table_head(
        "comparison | saved ms (mean ± std) | SE ms | % of unquantized | per round (ms) | direction | label | p",
        "pixel-identical | SSIM min | PSNR min",
    )
    per = ", ".join(f"{x:+.1f}" for x in t["saved_ms"]["per_round"])
    st = " | ".join(_num(t["stages_saved_ms"].get(s), "+.2f") for s in STAGES)
    if w:
        ident = f"{'yes' if w['pixel_identical'] else 'no'} ({w['samples']} images)"
        ssim, psnr = f"{w['ssim_min']:.4f}", fmt_db(w["psnr_db_min"])
    else:
        ident, ssim, psnr = f"– (missing {', '.join(im['missing'])})", "–", "–"
    lines += [
        f"| **{info['config']} vs {info['reference']}** | {_saved(t)} | {_num(t['se_ms'])} | "
        f"{_num(t['saved_pct_of_unquantized'], '+.2f', '%')} | {per} | {t['direction']} | {t['label']} | {_num(t['p_value'], '.2g')} | "
        f"{st} | {ident} | {ssim} | {psnr} |",
        "",
        f"Saved = time({info['reference']}) − time({info['config']}) per round, on the whole request (positive: the "
        f"quantization is faster); *p*: the signed-rank test on its own (not in the optimizations' family); label "
        f"against the noise floor ({_num(t['noise_floor_ms'])} ms)"
        + ("" if t["tested"] else " and two standard errors (too few rounds for the test)")
        + ". SSIM/PSNR: the quantized images against the "
        f"unquantized ones, worst image; for scale only, the close tier's gates are SSIM ≥ {gates['ssim']}, PSNR ≥ "
        f"{gates['psnr_db']} dB (not applied here).",
    ]
    return lines


def memory_section(configs: list[dict[str, Any]]) -> list[str]:
    """The peak-memory table (MiB and ratio to stock per measured call); empty when no worker measured."""
    measured = [c for c in configs if c.get("memory")]
    if not measured:
        return []
    cols = [f"{t} peak MiB (× stock)" for t in MEMORY_CALLS.values()]
    lines = [
        "",
        "## Peak memory",
        "",
        "Bytes of tensor storage allocated by one call and alive at its worst moment, over what existed before it "
        "(weights and inputs excluded; `testbed/memory.py`), on a warm request: one per configuration, before "
        "its timed samples.",
        "",
        *table_head(["configuration", *cols]),
    ]
    for c in measured:
        mem = c["memory"]
        if "error" in mem:
            cells = ["probe failed: " + str(mem["error"])[:80]] * len(cols)
        else:
            cells = [_peak_cell(mem.get(label)) for label in MEMORY_CALLS]
        lines.append(f"| `{c['id']}` | " + " | ".join(cells) + " |")
    return lines


def _peak_cell(m: dict[str, Any] | None) -> str:
    if not m:
        return "–"
    r = m.get("vs_stock")
    return f"{m['peak'] / 2**20:.2f}" + ("" if r is None else f" ({r:.3f}×)")


COLORS = {"gain": "#2e7d32", "regression": "#c62828", "within noise": "#9e9e9e"}


def write_chart(results: dict[str, Any], out: Path) -> Path:
    """Horizontal bars: mean time saved per optimization (and the full stack), std error bars, shaded noise band."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    rows = [(n, d) for n, _, d, _ in comparison_rows(results)]
    names = [f"{n}\n(on {_on(d)})" for n, d in rows]
    means = [d["saved_ms"]["mean"] or 0.0 for _, d in rows]
    stds = [d["saved_ms"]["std"] or 0.0 for _, d in rows]
    colors = [COLORS.get(d["label"], "#bdbdbd") for _, d in rows]
    fig, ax = plt.subplots(figsize=(8, 1.2 + 0.55 * max(1, len(rows))), dpi=110)
    y = list(range(len(rows)))[::-1]
    nf = results["noise_floor"]
    if nf:
        ax.axvspan(-nf["ms"], nf["ms"], color="#ffcc80", alpha=0.45, label=f"noise floor ±{nf['ms']:.2f} ms", lw=0)
    ax.barh(y, means, xerr=stds, color=colors, capsize=4, edgecolor="black", linewidth=0.5)
    ax.axvline(0, color="black", lw=0.8)
    ax.set_yticks(y, names)
    for yi, (_, d), m, sd in zip(y, rows, means, stds, strict=True):
        pct = d.get("saved_pct_of_stock")
        txt = f"{m:+.1f} ms" + (f" ({pct:+.1f}%)" if pct is not None else "") + f"  {d['label']}"
        # right of the bar's positive end (or of zero), never over the optimization names on the y axis
        end = m + sd if m >= 0 else max(0.0, nf["ms"] if nf else 0.0)
        ax.annotate(txt, (end, yi), xytext=(4, 0), textcoords="offset points", ha="left", va="center", fontsize=8)
    lo, hi = ax.get_xlim()
    span = max(hi - lo, 1e-6)
    ax.set_xlim(lo - 0.25 * span, hi + 0.35 * span)
    wl = results["workload"]
    ax.set_xlabel("time saved per image on its stages (ms, mean ± std over repeats; positive = faster)")
    ax.set_title(
        f"{wl['name']}: {results['plan']['workload']['mode']}, {wl['width']}×{wl['height']}, "
        f"{wl['steps']} steps — {results['verdict']['result']}",
        fontsize=10,
    )
    if nf:
        ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    path = atomic_write(Path(out) / "ablation.png", fig.savefig)
    plt.close(fig)
    return path


def write_all(results: dict[str, Any], out: Path) -> dict[str, Path]:
    """results.json, report.md and ablation.png in ``out``, each written atomically."""
    out = Path(out)
    return {
        "json": write_json(out / "results.json", results),
        "markdown": atomic_write(out / "report.md", markdown(results)),
        "chart": write_chart(results, out),
    }


def reference_section(ref: dict[str, Any] | None) -> list[str]:
    """report.md's table of each configuration against the external reference set (empty without one)."""
    if not ref:
        return []
    g = ref["gates"]
    lines = [
        "",
        "## Against the reference set",
        "",
        f"Each configuration's images against `{ref['path']}` (close gates SSIM ≥ {g['ssim']}, PSNR ≥ "
        f"{g['psnr_db']} dB; `vllm-omni-ascend-opt compare` gives the full report).",
    ]
    if differs := ref.get("differs"):
        lines.append("Differs from the set: " + "; ".join(f"{f['field']} {f['a']} → {f['b']}" for f in differs) + ".")
    lines += [
        "",
        *table_head(["configuration", "vs reference", "pixel-identical", "SSIM min", "PSNR min", "one side only"]),
    ]
    for cid, r in ref["configs"].items():
        if "error" in r:
            lines.append(f"| `{cid}` | not compared: {r['error']} | – | – | – | – |")
            continue
        mark = {True: "✅", False: "❌", None: "–"}[r["passed"]]
        ssim = _num(r["ssim_min"], ".4f")
        psnr = "–" if r["psnr_db_min"] is None else fmt_db(r["psnr_db_min"])
        lines.append(
            f"| `{cid}` | {mark} | {r['pixel_identical']}/{r['pairs']} | {ssim} | {psnr} | "
            f"{r['only_in_reference']} in the set, {r['only_here']} here |"
        )
    return lines
