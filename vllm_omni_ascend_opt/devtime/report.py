"""The device-time model's tables, labelled a model, as ``plan`` and ``benchmarks/bench_devtime.py`` print them."""

from __future__ import annotations

import textwrap
from typing import Any

from vllm_omni_ascend_opt.devtime import layouts
from vllm_omni_ascend_opt.devtime import model as M
from vllm_omni_ascend_opt.devtime import table as TB
from vllm_omni_ascend_opt.devtime.costs import ATTENTION, GEMM
from vllm_omni_ascend_opt.devtime.int8 import INT8_PEAK_RATIO, int8_table

HEAD = "device-time model (model, not measured; devtime/model.py, calibrated on the reference)"


def calibration(table: dict[str, Any]) -> M.Fit:
    """Fit the model on the reference points at the reference workload (1280x704, B=1) of ``table``."""
    wk = TB.workload_key(*TB.REFERENCE_RES, 1)
    calls = {
        n: (TB.call_ops(table, wk, n), TB.call_ops(table, wk, n, "vae"))
        for n in M.REFERENCE_MS
        if n in table["workloads"][wk]
    }
    return M.fit(calls)


def predictions(
    table: dict[str, Any], params: M.Params, workload: str, steps: int, cfg_forwards: int = 1, int8: bool = False
) -> dict[str, M.Prediction]:
    """Configuration -> :class:`~.model.Prediction` of one image at ``workload`` (``int8``: on the int8 op table)."""
    out = {}
    for name in table["workloads"][workload]:
        tr, vae = TB.call_ops(table, workload, name), TB.call_ops(table, workload, name, "vae")
        out[name] = M.predict(int8_table(tr) if int8 else tr, vae, params, steps, cfg_forwards)
    return out


def top_ops(
    table: dict[str, Any],
    params: M.Params,
    workload: str,
    config: str = "default",
    part: str = "transformer",
    n: int = 10,
    calls: int = 1,
) -> list[dict[str, Any]]:
    """The ``n`` ops of ``config`` that are neither GEMMs nor attention, by predicted ms for ``calls`` calls."""
    ops = TB.call_ops(table, workload, config, part).ops.values()
    rows = [
        {
            "op": o.name,
            "site": o.site.split("|")[0],
            "shapes": o.site.split("|")[1] if "|" in o.site else "",
            "launches": o.count * calls,
            "gbytes": o.bytes * calls / 1e9,
            "ms": M.op_ms(o, params) * calls,
        }
        for o in ops
        if o.kind not in (GEMM, ATTENTION)
    ]
    return sorted(rows, key=lambda r: -r["ms"])[:n]


def text_tables(table: dict[str, Any], fit: M.Fit, workload: str, steps: int, cfg_forwards: int = 1) -> list[str]:
    """The model's tables for one workload and step count, as lines of text (with the top 10 other ops)."""
    p, top = fit.params, 10
    preds = predictions(table, p, workload, steps, cfg_forwards)
    any_pred = next(iter(preds.values()))
    lines = [
        f"  {HEAD}",
        f"    {p.describe()}",
        f"    {workload}, {steps} steps, {cfg_forwards} forward(s) per step; compute floor (FLOPs / spec peak) "
        f"{any_pred.floor_ms:.0f} ms",
    ]
    for name in TB.ordered(preds):
        ms = preds[name].image_ms
        lines.append(f"    {name:<28} {ms:8.0f} ms   x{ms / preds[name].floor_ms:4.2f} of the floor")
    calls = steps * cfg_forwards
    per_step = preds["default"].transformer_ms * cfg_forwards if "default" in preds else 0.0
    heads = {
        "transformer": f"    top {top} ops of the default stack that are neither GEMMs nor attention (ms per image; "
        "% of the predicted default step):",
        "vae": f"    VAE decode (default), top {top} such ops:",
    }
    for part, n in (("transformer", calls), ("vae", 1)):
        lines.append(heads[part])
        for r in top_ops(table, p, workload, "default", part, top, n):
            share = f" {100 * r['ms'] / calls / per_step if per_step else 0.0:4.1f}%" if part == "transformer" else ""
            lines.append(
                f"      {r['ms']:7.1f} ms{share}  {r['op']:<28} {r['launches']:6d} launches {r['gbytes']:7.1f} GB"
                f"  {r['site']}"
            )
    return lines


def for_plan(
    configs: dict[str, list[str]],
    *,
    model: str,
    height: int,
    width: int,
    steps: int,
    cfg_forwards: int,
    cards: list[int] | None = None,
    quantization: str | None = None,
) -> dict[str, Any]:
    """``plan``'s model section: per plan configuration (id -> optimizations) the predicted ms and ms saved, the
    layouts for ``cards``, with ``quantization="int8"`` int8 too; ``note`` says why not."""
    out: dict[str, Any] = {"label": HEAD, "configs": {}, "note": ""}
    if model not in ("Qwen/Qwen-Image", "Qwen-Image"):
        out["note"] = f"the trace table holds Qwen-Image text-to-image only, not {model}"
        return out
    try:
        table = TB.load(TB.TABLE_FILE)
    except OSError as exc:
        out["note"] = f"no trace table ({exc}): run benchmarks/bench_devtime.py --write-table"
        return out
    wk = TB.workload_key(height, width, 1)
    if wk not in table["workloads"]:
        out["note"] = f"{width}x{height} is not in the trace table (traced: {', '.join(table['workloads'])})"
        return out
    fit = calibration(table)
    preds = predictions(table, fit.params, wk, steps, cfg_forwards)
    stock = preds["stock"].image_ms
    int8 = predictions(table, fit.params, wk, steps, cfg_forwards, int8=True) if quantization == "int8" else None
    for cid, opts in configs.items():
        name = TB.find_config(table, opts)
        ms = preds[name].image_ms if name else None
        out["configs"][cid] = {
            "table_config": name,
            "model_ms": ms,
            "model_ms_saved": None if ms is None else stock - ms,
        }
        if int8 is not None:
            i8, floor = int8[name].image_ms if name else None, preds["stock"].floor_ms
            x, xi = (None if v is None else v / floor for v in (ms, i8))
            out["configs"][cid] |= {"x_floor": x, "int8_ms": i8, "int8_x_floor": xi}
    if int8 is not None:
        out["int8_note"] = (
            "int8: vLLM-Omni's NPU int8 priced on the bf16 trace (devtime/int8.py): the blocks' GEMMs at the int8 "
            f"peak ({INT8_PEAK_RATIO:g}x bf16), one npu_dynamic_quant each by its bytes; x = ms / the bf16 compute "
            "floor. Not priced: the weight layout (NZ int8 weights have the FLOPs and bytes of ND ones: 0 ms here)"
        )
    out["params"] = fit.params.describe()
    out["calibration"] = fit.rows()
    out["tables"] = text_tables(table, fit, wk, steps, cfg_forwards)
    out["workload"] = wk
    if cards:
        out["layouts"] = layouts.text_table(table, fit.params, height, width, steps, cards, cfg_forwards > 1)
    return out


def _num(v: float | None, fmt: str) -> str:
    return "n/a" if v is None else format(v, fmt)


def plan_lines(section: dict[str, Any]) -> list[str]:
    """``plan``'s text for :func:`for_plan`'s section (with its multi-card layouts, when it has them)."""
    lines = [f"\n  {section['label']}, per plan configuration:"]
    if section["note"]:
        return [*lines, f"    not available: {section['note']}"]
    int8 = "int8_note" in section
    extra = f"  {'x floor':>7} {'int8 ms':>8} {'x floor':>7}" if int8 else ""
    lines.append(f"    {'configuration':<26} {'model ms':>9} {'saved':>7}{extra}")
    for cid, row in section["configs"].items():
        ms, saved = row["model_ms"], row["model_ms_saved"]
        if int8:
            x, i8, xi = (row[k] for k in ("x_floor", "int8_ms", "int8_x_floor"))
            extra = f"  {_num(x, '.2f'):>7} {_num(i8, '.0f'):>8} {_num(xi, '.2f'):>7}"
        lines.append(f"    {cid:<26} {_num(ms, '.0f'):>9} {'' if saved is None else f'{saved:.0f}':>7}{extra}")
    if int8:
        lines.append(textwrap.fill(section["int8_note"], 110, initial_indent="    ", subsequent_indent="    "))
    lines += ["", *section["tables"], "  calibration residuals:", *(f"    {r}" for r in section["calibration"])]
    if section.get("layouts"):
        lines += ["", *section["layouts"]]
    return lines
