"""``plan --measured``: the device-time model beside the kernel timings saved with the verdicts, the attention and
GEMM efficiencies refitted from them, and how far the prediction moved (``devtime/measured.py``), on CPU with a
synthetic saved-verdict file."""

from __future__ import annotations

import json

import pytest

from vllm_omni_ascend_opt.devtime import measured
from vllm_omni_ascend_opt.devtime import model as M
from vllm_omni_ascend_opt.devtime import report as R
from vllm_omni_ascend_opt.devtime import table as TB

ATTN = "npu|bfloat16|BSND|32|1|8192|8192|128|False"  # 1328x1328: 6889 image + text tokens, 24 heads
NORM = "npu|bfloat16|16384|128"
GEMM = "npu|bfloat16|3072|3072|4096"


def _t(kernel_ms: float, stock_ms: float, candidate: str | None, name: str) -> dict:
    return {"candidate": candidate, "kernel_ms": kernel_ms, "stock_ms": stock_ms, "ratio": kernel_ms / stock_ms,
            "repeats": 5, "candidates": {name: kernel_ms}}  # fmt: skip


def synthetic(path, attn_scale: float = 2.0, gemm_scale: float = 0.5) -> dict:
    """A saved-verdict file whose attention runs ``attn_scale`` x and GEMM ``gemm_scale`` x the model's ms."""
    params = R.calibration(TB.load(TB.TABLE_FILE)).params
    attn = M.op_ms(measured.op_of("npu_fusion_attention", ATTN), params) * attn_scale
    gemm = M.op_ms(measured.op_of(measured.NZ_KERNEL, GEMM), params) * gemm_scale
    verdicts = {
        "npu_fusion_attention": {ATTN: [True, "ok", _t(attn, attn * 1.25, "npu_fusion_attention/BNSD", "x")]},
        "npu_rms_norm": {NORM: [False, "slower: kernel 0.05 ms, stock 0.04 ms", _t(0.05, 0.04, None, "npu_rms_norm")]},
        measured.NZ_KERNEL: {GEMM: [True, "timed", _t(gemm, gemm * 1.1, "npu_format_cast", "npu_format_cast")]},
        "npu_rotary_mul": {"npu|bfloat16|BSND|32|8192|128": [True, "untimed", None]},
    }
    path.write_text(json.dumps({"format": 2, "env": {}, "verdicts": verdicts}))
    return {"params": params, "attn": attn, "gemm": gemm}


def test_rows_refit_and_the_prediction_move(tmp_path):
    f = tmp_path / "verdicts.json"
    s = synthetic(f)
    rows = measured.rows(measured.load(f), s["params"])
    by = {r["kernel"]: r for r in rows}
    assert set(by) == {"npu_fusion_attention", "npu_rms_norm", measured.NZ_KERNEL}  # the untimed class is left out
    assert by["npu_fusion_attention"]["measured_ms"] == pytest.approx(2 * by["npu_fusion_attention"]["model_ms"])
    assert by["npu_rms_norm"]["measured_ms"] == 0.04 and by["npu_rms_norm"]["candidate"] == "stock"  # what ran
    new = measured.refit(s["params"], rows)
    assert new.attn_eff == pytest.approx(s["params"].attn_eff / 2, rel=0.03)  # half as fast as the model said
    assert new.gemm_eff == pytest.approx(min(1.0, s["params"].gemm_eff * 2), rel=0.03)
    lines = measured.section(f)
    text = "\n".join(lines)
    assert "refit: attention" in text and "the prediction moved" in text
    before, after = (float(x) for x in text.split("50 steps: ")[1].split(" ms (")[0].split(" ms -> "))
    assert after != before


def test_plan_measured_prints_the_section(tmp_path, capsys):
    from vllm_omni_ascend_opt.cli import main

    f = tmp_path / "verdicts.json"
    synthetic(f)
    assert main(["plan", "--workload", "tiny-cpu", "--out", str(tmp_path / "o"), "--measured", str(f)]) == 0
    out = capsys.readouterr().out
    assert "measured kernel timings" in out and "npu_fusion_attention" in out and "refit: attention" in out
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"format": 9}))
    with pytest.raises(ValueError, match="not a saved-verdict file"):
        measured.load(bad)
