"""vLLM-Omni's NPU int8 in the device-time model and ``plan --quantization int8`` (a model, never a measurement)."""

from __future__ import annotations

import pytest

from vllm_omni_ascend_opt import cli
from vllm_omni_ascend_opt.ablation.workload import load_workload
from vllm_omni_ascend_opt.devtime import int8 as I8
from vllm_omni_ascend_opt.devtime import model as M
from vllm_omni_ascend_opt.devtime import report as R
from vllm_omni_ascend_opt.devtime.costs import GEMM, OTHER
from vllm_omni_ascend_opt.devtime.trace import BLOCKS, OpTable

SITE = "vllm/model_executor/layers/utils.py:90|"


def _table() -> OpTable:
    t = OpTable()
    m, k, n = 4096, 3072, 12288
    t.add("addmm", GEMM, f"{SITE}{n},{m}x{k},{k}x{n}", 2.0 * m * k * n * BLOCKS, 2.0 * (m * k + k * n + m * n) * BLOCKS,
          BLOCKS)  # fmt: skip
    mod = 2.0 * 3072 * 18432 * 2 * BLOCKS  # the modulation (M = 1): kept in bf16
    t.add("addmm", GEMM, f"{SITE}18432,1x3072,3072x18432", mod, mod, 2 * BLOCKS)
    t.add("addmm", GEMM, f"{SITE}3072,4096x64,64x3072", 2.0 * 4096 * 64 * 3072, 1e6, 1)  # img_in: outside
    t.add("gelu", OTHER, "x.py:1|4096x12288", 4096 * 12288 * BLOCKS, 4.0 * 4096 * 12288 * BLOCKS, BLOCKS)
    return t


def test_int8_table_quantizes_the_blocks_gemms_and_adds_one_dynamic_quant_each():
    bf16 = _table()
    i8 = I8.int8_table(bf16)
    kinds = {(o.name, o.kind): o for o in i8.ops.values()}
    gemm = next(o for o in i8.ops.values() if o.kind == I8.GEMM_INT8)
    assert gemm.count == BLOCKS and gemm.flops == next(iter(bf16.ops.values())).flops  # same FLOPs
    m, k, n = 4096, 3072, 12288
    assert gemm.bytes == (m * k + k * n + 2 * m * n + 4 * m + 4 * n + 2 * n) * BLOCKS  # int8 operands, bf16 out
    quant = kinds[(I8.QUANT_OP, OTHER)]
    assert quant.count == BLOCKS and quant.bytes == (3 * m * k + 4 * m) * BLOCKS and quant.flops == 0
    assert [o.kind for o in i8.ops.values()].count(GEMM) == 2  # the modulation and img_in stay bf16
    assert i8.flops == bf16.flops  # the compute floor is the bf16 one
    p = M.Params(0.6, 0.45, 0.6, 0.4, 10.0, 150.0)
    bf16_gemm = next(iter(bf16.ops.values()))
    # compute-bound: twice the peak, so half the compute time (launch overhead aside)
    launch = BLOCKS * p.launch_us * 1e-3
    assert M.op_ms(gemm, p) - launch == pytest.approx((M.op_ms(bf16_gemm, p) - launch) / I8.INT8_PEAK_RATIO)
    assert M.op_ms(quant, p) == pytest.approx(quant.bytes / (p.bw_eff * p.spec.hbm_gbps * 1e9) * 1e3 + launch)


def test_gemm_shape_reads_addmm_and_mm_sites():
    assert I8.gemm_shape(f"{SITE}9216,6889x3072,3072x9216") == (6889, 3072, 9216)
    assert I8.gemm_shape("x.py:3|6889x3072,3072x9216") == (6889, 3072, 9216)
    assert I8.gemm_shape("x.py:3|6889x3072,64x9216") is None and I8.gemm_shape("x.py:3") is None


def _section(**kw):
    section = R.for_plan({"stock": [], "full": ["shared_modulation", "rope", "joint_attention", "vae_exact"]},
                         model="Qwen/Qwen-Image", height=704, width=1280, steps=8, cfg_forwards=1, **kw)  # fmt: skip
    if section["note"]:
        pytest.skip(section["note"])
    return section


def test_plan_section_prices_int8_beside_bf16_against_the_bf16_floor():
    bf16, i8 = _section(), _section(quantization="int8")
    assert "int8_ms" not in bf16["configs"]["stock"] and "int8_note" not in bf16
    for cid in ("stock", "full"):
        row = i8["configs"][cid]
        assert row["model_ms"] == bf16["configs"][cid]["model_ms"]  # bf16 figures unchanged
        assert row["int8_ms"] < row["model_ms"]  # the GEMMs at twice the peak
        assert row["int8_x_floor"] / row["x_floor"] == pytest.approx(row["int8_ms"] / row["model_ms"])
    assert i8["configs"]["full"]["int8_ms"] < i8["configs"]["stock"]["int8_ms"]  # the plugin on top of int8
    text = " ".join("\n".join(R.plan_lines(i8)).split())
    assert "int8 ms" in text and "Not priced: the weight layout" in text
    assert "int8 ms" not in "\n".join(R.plan_lines(bf16))


def test_workload_and_cli_flag_select_int8_pricing(capsys):
    wl = load_workload("qwen-image-910b1-int8")
    assert wl.od_config == {"quantization_config": "int8"} and wl.validate()
    assert cli.main(["plan", "--workload", "qwen-image-910b1-int8"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    if "not available" in out:
        pytest.skip(out)
    assert "int8 ms" in out and "Not priced: the weight layout" in out
    assert cli.main(["plan", "--workload", "qwen-image-910b1", "--quantization", "int8"]) == 0
    assert "int8 ms" in capsys.readouterr().out
    assert cli.main(["plan", "--workload", "qwen-image-910b1"]) == 0
    assert "int8 ms" not in capsys.readouterr().out
