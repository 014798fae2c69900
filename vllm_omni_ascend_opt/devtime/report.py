"""What the device-time model tells, as tables: ``plan`` and ``benchmarks/bench_devtime.py`` print these.

* :func:`calibration`: the fit on the reference workload of the trace table, with each point's residual;
* :func:`predictions`: per configuration, predicted ms per image, and as a multiple of the compute floor;
* :func:`top_ops`: the ops of a configuration that are neither GEMMs nor attention, by predicted ms per image;
* :func:`text_tables`: all of it as text, labelled a model.
"""

from __future__ import annotations

import functools
from typing import Any

from vllm_omni_ascend_opt.devtime import model as M
from vllm_omni_ascend_opt.devtime import table as TB
from vllm_omni_ascend_opt.devtime.costs import ATTENTION, GEMM

HEAD = "device-time model (model, not measured; devtime/model.py, calibrated on the reference)"


@functools.cache
def _cached_fit(path: str) -> M.Fit:
    return calibration(TB.load(TB.TABLE_FILE if path == "" else path))


def calibration(table: dict[str, Any] | None = None) -> M.Fit:
    """Fit the model on the reference points at the reference workload (1280x704, B=1) of ``table``."""
    if table is None:
        return _cached_fit("")
    wk = TB.workload_key(*TB.REFERENCE_RES, 1)
    calls = {
        n: (TB.call_ops(table, wk, n), TB.call_ops(table, wk, n, "vae"))
        for n in M.REFERENCE_MS
        if n in table["workloads"][wk]
    }
    return M.fit(calls)


def predictions(
    table: dict[str, Any], params: M.Params, workload: str, steps: int, cfg_forwards: int = 1
) -> dict[str, M.Prediction]:
    """Configuration -> :class:`~.model.Prediction` of one image at ``workload`` (a key of the table)."""
    out = {}
    for name in table["workloads"][workload]:
        tr, vae = TB.call_ops(table, workload, name), TB.call_ops(table, workload, name, "vae")
        out[name] = M.predict(tr, vae, params, steps, cfg_forwards)
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


def _pred_line(name: str, p: M.Prediction) -> str:
    return f"    {name:<22} {p.image_ms:8.0f} ms   x{p.image_ms / p.floor_ms:4.2f} of the floor"


def text_tables(
    table: dict[str, Any],
    fit: M.Fit,
    workload: str,
    steps: int,
    cfg_forwards: int = 1,
    *,
    configs: list[str] | None = None,
    top: int = 10,
) -> list[str]:
    """The model's tables for one workload and step count, as lines of text."""
    p = fit.params
    preds = predictions(table, p, workload, steps, cfg_forwards)
    any_pred = next(iter(preds.values()))
    lines = [
        f"  {HEAD}",
        f"    {p.describe()}",
        f"    {workload}, {steps} steps, {cfg_forwards} forward(s) per step; compute floor (FLOPs / spec peak) "
        f"{any_pred.floor_ms:.0f} ms",
    ]
    for name in configs or list(preds):
        if name in preds:
            lines.append(_pred_line(name, preds[name]))
    calls = steps * cfg_forwards
    per_step = preds["default"].transformer_ms * cfg_forwards if "default" in preds else 0.0
    lines.append(
        f"    top {top} ops of the default stack that are neither GEMMs nor attention (ms per image; "
        f"% of the predicted default step):"
    )
    for r in top_ops(table, p, workload, "default", "transformer", top, calls):
        share = 100 * r["ms"] / calls / per_step if per_step else 0.0
        lines.append(
            f"      {r['ms']:7.1f} ms {share:4.1f}%  {r['op']:<28} {r['launches']:6d} launches {r['gbytes']:7.1f} GB"
            f"  {r['site']}"
        )
    lines.append(f"    VAE decode (default), top {top} such ops:")
    for r in top_ops(table, p, workload, "default", "vae", top, 1):
        lines.append(
            f"      {r['ms']:7.1f} ms  {r['op']:<28} {r['launches']:6d} launches {r['gbytes']:7.1f} GB  {r['site']}"
        )
    return lines


def calibration_lines(fit: M.Fit) -> list[str]:
    return [f"  calibration ({M.LABEL}): {fit.params.describe()}", *(f"    {r}" for r in fit.rows())]
