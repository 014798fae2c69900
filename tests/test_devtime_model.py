"""The device-time model (``devtime/model.py``) on the committed trace table; multi-card collectives; ``plan``.

* predicted op times by hand (GEMM, element-wise, launch overhead); the fit reproduces its calibration points
  within their residuals and the held-out VAE point; an image is steps x CFG forwards + the VAE + the constant;
* the collectives of each parallel mode (``devtime/layouts.py``) equal what the gloo runs of tests/test_parallel.py
  count on the real code (the same spawn);
* ``plan --cards 2`` prints the model's tables labelled as a model and names the best 2-card layout.
"""

from __future__ import annotations

import json

import pytest

from vllm_omni_ascend_opt.cli import main
from vllm_omni_ascend_opt.devtime import layouts as L
from vllm_omni_ascend_opt.devtime import model as M
from vllm_omni_ascend_opt.devtime import report
from vllm_omni_ascend_opt.devtime import table as TB
from vllm_omni_ascend_opt.devtime.trace import Op, OpTable

REF = TB.workload_key(*TB.REFERENCE_RES, 1)
P = M.Params(gemm_eff=0.5, attn_eff=0.4, bw_eff=0.5, gemm_bw_eff=0.25, launch_us=2.0, const_ms=100.0)


@pytest.fixture(scope="module")
def table():
    return TB.load(TB.TABLE_FILE)


@pytest.fixture(scope="module")
def fit(table):
    return report.calibration(table)


def test_op_time_by_hand():
    peak, bw = M.SPECS["910B1"].peak_tflops * 1e12, M.SPECS["910B1"].hbm_gbps * 1e9
    gemm = Op("addmm", "gemm", "x", count=3, flops=3e12, bytes=1e9)
    assert M.op_ms(gemm, P) == pytest.approx((3e12 / (0.5 * peak) + 3 * 2e-6) * 1e3)  # compute-bound
    gemv = Op("addmm", "gemm", "x", count=1, flops=1e8, bytes=1e9)
    assert M.op_ms(gemv, P) == pytest.approx((1e9 / (0.25 * bw) + 2e-6) * 1e3)  # weight-bound: GEMM bandwidth
    mul = Op("mul.Tensor", "other", "x", count=10, flops=1e12, bytes=2e9)
    assert M.op_ms(mul, P) == pytest.approx((2e9 / (0.5 * bw) + 10 * 2e-6) * 1e3)  # priced by bytes only
    attn = Op("scaled_dot_product_attention", "attention", "x", count=1, flops=4e12, bytes=1e6)
    assert M.op_ms(attn, P) == pytest.approx((4e12 / (0.4 * peak) + 2e-6) * 1e3)


def test_image_is_steps_times_forwards_times_call_plus_vae_plus_constant():
    tr, vae = OpTable(), OpTable()
    tr.add("addmm", "gemm", "x", 1e12, 1e6, 5)
    vae.add("mul.Tensor", "other", "y", 1.0, 1e9, 2)
    got = M.predict(tr, vae, P, steps=4, cfg_forwards=2)
    assert got.image_ms == pytest.approx(8 * M.call_ms(tr, P) + M.call_ms(vae, P) + 100.0)
    assert got.floor_ms == pytest.approx((8e12 + 1) / (M.SPECS["910B1"].peak_tflops * 1e12) * 1e3)


def test_fit_reproduces_its_calibration_points_within_the_printed_residuals(table, fit):
    assert set(fit.points) == set(M.REFERENCE_MS)
    for name, (ref, got, residual, used) in fit.points.items():
        pred = M.predict(TB.call_ops(table, REF, name), TB.call_ops(table, REF, name, "vae"), fit.params, 8)
        assert pred.image_ms == pytest.approx(got) and got - ref == pytest.approx(residual), name
        assert used == (name in M.FIT_POINTS)
        if name != "default":
            assert abs(residual) <= 25.0, (name, residual)
    assert any(f"residual {fit.points['stock'][2]:+6.1f} ms (fit)" in r for r in fit.rows())
    # the blind spot: NZ weights and attention fusion change no FLOP, byte or launch the trace sees
    assert fit.points["default"][1] == pytest.approx(fit.points["pixel+vae"][1], abs=5.0)
    assert fit.points["default"][2] > 100.0
    p = fit.params
    assert 0.2 < p.gemm_eff <= 1 and 0.2 < p.attn_eff <= 1 and p.gemm_bw_eff < p.bw_eff and 0 < p.const_ms < 1000


def test_fit_moves_with_its_points(table):
    calls = {n: (TB.call_ops(table, REF, n), TB.call_ops(table, REF, n, "vae")) for n in M.REFERENCE_MS}
    slower = {**M.REFERENCE_MS, "stock": M.REFERENCE_MS["stock"] + 300.0}
    base, moved = M.fit(calls), M.fit(calls, reference=slower)
    assert moved.points["stock"][1] > base.points["stock"][1] + 100.0


def test_predictions_cover_every_workload_and_configuration(table, fit):
    assert set(table["workloads"]) == {TB.workload_key(h, w, b) for h, w in TB.RESOLUTIONS for b in TB.BATCHES}
    assert set(table["configs"]) == set(TB.configurations()), "run benchmarks/bench_devtime.py --write-table"
    for wk in table["workloads"]:
        preds = report.predictions(table, fit.params, wk, steps=8)
        assert preds["default"].image_ms < preds["stock"].image_ms
        assert all(p.image_ms > p.floor_ms for p in preds.values())
    rows = report.top_ops(table, fit.params, TB.workload_key(1328, 1328, 1), "default", "transformer", 10, 8)
    assert len(rows) == 10 and all(r["op"] not in ("addmm", "scaled_dot_product_attention") for r in rows)


_LAYOUT = {
    "ulysses": L.Layout(ulysses=2),
    "ring": L.Layout(ring=2),
    "tensor_parallel": L.Layout(tp=2),
    "cfg_parallel": L.Layout(cfg=2),
}


@pytest.mark.multiproc
@pytest.mark.xdist_group("parallel_run")  # test_parallel's gloo spawn
@pytest.mark.parametrize("mode", list(_LAYOUT))
def test_collectives_equal_what_the_gloo_runs_count(mode, tiny_model_dir):
    from tests.test_parallel import _get_run
    from vllm_omni_ascend_opt.testbed.tiny_model import TINY

    run = _get_run(mode, tiny_model_dir)
    job = next(j for j in run.ranks[0].jobs if j.job.tag == "none/B")  # 16x40 px: 10 image tokens, no padding
    seen = job.collectives
    s, steps = 10, job.job.steps
    kw = dict(hidden=TINY.inner_dim, channels=TINY.vae_z_dim * 4, el=4, blocks=TINY.num_layers, batch=1)
    if mode == "cfg_parallel":
        want = L.cfg_collectives(batch=1, image_tokens=s, channels=kw["channels"], el=4)
        assert seen == {n: [c * steps, b * steps] for n, (c, b) in want.items()}
        return
    calls = steps * 2  # true CFG: two transformer calls per step
    # the text length is the prompt's: read it off the one collective that carries the text stream
    text = 0
    if mode == "tensor_parallel":
        text = seen["allreduce_"][1] // calls // (2 * kw["blocks"] * kw["hidden"] * 4) - s
    elif mode == "ulysses":
        text = 2 * seen["allgather_"][1] // calls // (kw["blocks"] * kw["hidden"] * 4)
    want = L.collectives(_LAYOUT[mode], image_tokens=s, text_tokens=text, **kw)
    assert text >= 0
    counted = {n: v for n, v in seen.items() if n != "recv_"}
    assert counted == {n: [c * calls, b * calls] for n, (c, b) in want.items()}, (mode, seen)
    if mode == "ring":
        assert seen["recv_"][0] == seen["send"][0]


def test_layouts_name_a_best_and_price_tp_above_sp(table, fit):
    lines = L.text_table(table, fit.params, 1024, 1024, 8, [2], cfg=True)
    assert any(line.strip().startswith("best for 2 cards: CFG2") for line in lines)
    tp = L.predict(table, fit.params, L.Layout(tp=2), "default", 1024, 1024, 8)
    usp = L.predict(table, fit.params, L.Layout(ulysses=2), "default", 1024, 1024, 8)
    one = L.predict(table, fit.params, L.Layout(), "default", 1024, 1024, 8)
    assert usp["ms"] < tp["ms"] < one["ms"] and tp["comm_ms_per_step"] > usp["comm_ms_per_step"] > 0


def test_plan_prints_the_model_with_its_calibration_and_layouts(capsys, tmp_path):
    args = ["plan", "--workload", "qwen-image-910b1", "--out", str(tmp_path / "o"), "--cards", "2"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "device-time model (model, not measured" in out and "launch-only" not in out
    assert "x compute floor" in out or "of the floor" in out
    assert "calibration residuals:" in out and "best for 2 cards:" in out
    assert main(["plan", "--json", *args[1:]]) == 0
    data = json.loads(capsys.readouterr().out)
    rows = data["devtime_model"]["configs"]
    assert rows["stock"]["model_ms_saved"] == 0 and rows["full"]["model_ms"] is not None
    assert rows["full"]["model_ms_saved"] > 0 and "launch_estimate" not in data
    assert main([*args[:-2], "--cards", "two"]) == 2


def test_plan_names_why_there_is_no_model_for_the_edit_workload(capsys, tmp_path):
    assert main(["plan", "--workload", "qwen-image-edit-2511-910b1", "--out", str(tmp_path / "o")]) == 0
    assert "not available: the trace table holds Qwen-Image text-to-image only" in capsys.readouterr().out
