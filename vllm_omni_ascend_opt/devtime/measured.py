"""The kernel timings saved with the verdicts (``blocks/kernels/saved.py``, format 2) beside the device-time model.

Each timed class's key gives its sizes (its bucket's top), so :func:`.model.op_ms` prices the same op beside the
measured ms. The attention and GEMM efficiencies are refitted (least squares in log ms) to what ran (the winner, else
stock), and ``plan``'s prediction of an image is given before and after.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

from vllm_omni_ascend_opt.blocks.kernels.nz_check import NZ_TIMING as NZ_KERNEL
from vllm_omni_ascend_opt.devtime import model as M
from vllm_omni_ascend_opt.devtime.costs import ATTENTION, GEMM, OTHER
from vllm_omni_ascend_opt.devtime.trace import Op


def load(path: Path) -> dict[str, Any]:
    """The verdict table of a saved-verdict file: {kernel: {class key text: [ok, reason, timing]}}."""
    data = json.loads(Path(path).read_text())
    if data.get("format") not in (1, 2) or not isinstance(data.get("verdicts"), dict):
        raise ValueError(f"{path}: not a saved-verdict file (format {data.get('format')!r})")
    return data["verdicts"]


def op_of(kernel: str, key: str) -> Op | None:
    """The op a timed class stands for (kind, FLOPs, bytes, one launch), from its key text; None when unknown."""
    p = key.split("|")
    el = {"bfloat16": 2, "float16": 2, "float32": 4}.get(p[1], 2) if len(p) > 1 else 2
    if kernel == "npu_fusion_attention" and len(p) == 9:
        bn, group, sq, skv, d = (int(x) for x in p[3:8])
        nbytes = el * d * (2 * bn * sq + 2 * (bn // max(1, group)) * skv)
        return Op(kernel, ATTENTION, key, 1, 4.0 * bn * sq * skv * d, float(nbytes))
    if kernel == "npu_rotary_mul" and len(p) == 6:
        bn, s, d = (int(x) for x in p[3:6])
        return Op(kernel, OTHER, key, 1, 3.0 * bn * s * d, float(el * (2 * bn * s * d + 2 * s * d)))
    if kernel == "npu_rms_norm" and len(p) == 4:
        rows, d = int(p[2]), int(p[3])
        return Op(kernel, OTHER, key, 1, 4.0 * rows * d, float(el * (2 * rows * d + d)))
    if kernel == NZ_KERNEL and len(p) == 5:
        n, k, rows = (int(x) for x in p[2:5])
        return Op(kernel, GEMM, key, 1, 2.0 * rows * n * k, float(el * (rows * k + n * k + rows * n)))
    return None


def rows(verdicts: dict[str, Any], params: M.Params) -> list[dict[str, Any]]:
    """Per timed op and class: the model's ms, the measured ms of what ran (winner, else stock), and stock's."""
    out = []
    for kernel, classes in sorted(verdicts.items()):
        for key, entry in sorted(classes.items()):
            t = entry[2] if isinstance(entry, list) and len(entry) == 3 and isinstance(entry[2], dict) else None
            op = op_of(kernel, key)
            if t is None or op is None or t.get("stock_ms") is None:
                continue
            ran = t["kernel_ms"] if t.get("candidate") else t["stock_ms"]
            out.append({"kernel": kernel, "class": key, "kind": op.kind, "op": op, "model_ms": M.op_ms(op, params),
                        "measured_ms": ran, "stock_ms": t["stock_ms"], "candidate": t.get("candidate") or "stock"})  # fmt: skip
    return out


def refit(params: M.Params, measured: list[dict[str, Any]]) -> M.Params:
    """``params`` with ``attn_eff`` / ``gemm_eff`` fitted to the measured ops of their kind (unchanged without any)."""
    fields = {ATTENTION: "attn_eff", GEMM: "gemm_eff"}
    new = dataclasses.asdict(params)
    for kind, field in fields.items():
        ops = [r for r in measured if r["kind"] == kind and r["measured_ms"] > 0]
        if not ops:
            continue

        def loss(eff: float, ops: list = ops, field: str = field) -> float:
            p = M.Params(**{**new, field: eff})
            return sum((math.log(M.op_ms(r["op"], p)) - math.log(r["measured_ms"])) ** 2 for r in ops)

        grid = [0.01 * 1.02**i for i in range(233)]  # 1% .. ~100% of peak
        new[field] = min(grid, key=loss)
    return M.Params(**new)


def section(path: Path, height: int = 1328, width: int = 1328, steps: int = 50, cfg_forwards: int = 2) -> list[str]:
    """``plan --measured``'s text: per op and class model vs measured ms, the refitted efficiencies, and the move."""
    from vllm_omni_ascend_opt.devtime import report as R
    from vllm_omni_ascend_opt.devtime import table as TB

    table = TB.load(TB.TABLE_FILE)
    params = R.calibration(table).params
    measured = rows(load(path), params)
    lines = [f"\n  measured kernel timings ({path}) beside the {M.LABEL}:"]
    if not measured:
        return [*lines, "    none: the file holds no timed class (VLLM_OMNI_ASCEND_OPT_TIMING=0, or format 1)"]
    lines.append(f"    {'kernel':<26} {'class':<44} {'model ms':>9} {'measured':>9} {'stock':>8}  ran")
    for r in measured:
        lines.append(f"    {r['kernel']:<26} {r['class']:<44} {r['model_ms']:9.4f} {r['measured_ms']:9.4f} "
                     f"{r['stock_ms']:8.4f}  {r['candidate']}")  # fmt: skip
    new = refit(params, measured)
    lines.append(
        f"    refit: attention {params.attn_eff:.0%} -> {new.attn_eff:.0%} of peak, GEMM {params.gemm_eff:.0%} -> "
        f"{new.gemm_eff:.0%}"
    )
    wk = TB.workload_key(height, width, 1)
    if wk in table["workloads"]:
        before = R.predictions(table, params, wk, steps, cfg_forwards)["default"].image_ms
        after = R.predictions(table, new, wk, steps, cfg_forwards)["default"].image_ms
        lines.append(f"    default stack, {width}x{height}, {steps} steps: {before:.0f} ms -> {after:.0f} ms "
                     f"({after - before:+.0f} ms, {(after - before) / before:+.1%}): the prediction moved by that")  # fmt: skip
    return lines
