"""``vs_unquantized`` (issue 39): the workload's quantized stock (vLLM-Omni's int8) against stock without the
quantization, reported as information and never judged. vLLM-Omni's int8 cannot run on CPU, so the runner is driven
by the protocol-speaking fake worker, which saves time and changes the image when its job's od_config quantizes."""

from __future__ import annotations

import json

import pytest

from tests.test_ablation_runner import GOOD, make_plan, run
from vllm_omni_ascend_opt import cli
from vllm_omni_ascend_opt.ablation.plan import INFORMATION, UNQUANTIZED
from vllm_omni_ascend_opt.ablation.schema import validate
from vllm_omni_ascend_opt.ablation.workload import WorkloadError, from_mapping, load_workload

INT8 = {"quantization_config": "int8", "vae_use_slicing": True}
QUANT = {**GOOD, "quantized_ms": 30.0, "quantized_perturb": 0.02}


def test_the_information_configuration_drops_the_quantization_only():
    plan = make_plan(od_config=INT8, vs_unquantized=True)
    (info,) = [c for c in plan.configs if c.role == INFORMATION]
    assert info.id == UNQUANTIZED and info.opts == () and info.od_drop == ("quantization_config",)
    assert info.od_config(INT8) == {"vae_use_slicing": True}
    assert all(c.od_config(INT8) == INT8 for c in plan.configs if c is not info)
    assert UNQUANTIZED not in {x for cmp in plan.comparisons for x in (cmp.with_, cmp.without)}
    # off by default; a plan without it keeps its fingerprint (no od_drop in it)
    plain = make_plan(od_config=INT8)
    assert [c.id for c in plain.configs] == [c.id for c in plan.configs if c is not info]
    assert plain.fingerprint() != plan.fingerprint()
    assert "od_drop" not in plain.configs[0].as_dict()
    with pytest.raises(WorkloadError, match=r"vs_unquantized .* quantization_config"):
        from_mapping({"vs_unquantized": True, "od_config": {"vae_use_slicing": True}}).validate()


def test_int8_stock_against_bf16_stock_is_information_outside_the_verdict(tmp_path, monkeypatch):
    plan = make_plan(od_config=INT8, vs_unquantized=True)
    _, res = run(plan, tmp_path / "out", monkeypatch, QUANT)
    out = tmp_path / "out"
    assert validate(json.loads((out / "results.json").read_text())) == []
    jobs = {c.id: json.loads((out / "configs" / c.id / "job.json").read_text()) for c in plan.configs}
    assert jobs[UNQUANTIZED]["od_config"] == {"vae_use_slicing": True}  # without the quantization, nothing else
    assert all(j["od_config"] == INT8 for cid, j in jobs.items() if cid != UNQUANTIZED)
    info = res["information"]["vs_unquantized"]
    assert (info["reference"], info["config"], info["quantization"]) == (UNQUANTIZED, "stock", "int8")
    assert info["status"] == "ok" and info["in_verdict"] is False
    t = info["time"]
    assert t["saved_ms"]["per_round"] == pytest.approx([30.0, 30.0]) and t["label"] == "gain"
    assert t["stages_saved_ms"]["denoise"] == pytest.approx(30.0) and t["se_ms"] == pytest.approx(0.0)
    assert t["unquantized_ms"] == pytest.approx(100.0) and t["quantized_ms"] == pytest.approx(70.0)
    assert t["saved_pct_of_unquantized"] == pytest.approx(30.0)
    assert t["p_value"] is not None and t["noise_floor_ms"] == pytest.approx(0.5)
    w = info["image"]["worst"]
    assert w["samples"] == 2 and not w["pixel_identical"] and w["ssim_min"] < 1.0 and w["psnr_db_min"] < 60
    # the int8 images differ from bf16's, yet the run passes: the tiers are judged against int8 stock
    assert res["verdict"]["result"] == "PASS", res["verdict"]
    assert not any(UNQUANTIZED in r for r in res["verdict"]["reasons"])
    assert res["full_vs_stock"]["saved_ms"]["mean"] == pytest.approx(15.0)  # int8 stock, not bf16
    cfg = next(c for c in res["configs"] if c["id"] == UNQUANTIZED)
    assert cfg["role"] == INFORMATION and cfg["vs_stock"] is None and cfg["vs_full"] is None
    md = (out / "report.md").read_text()
    assert "## Information: int8 stock vs stock without quantization (not in the verdict)" in md
    assert f"| **stock vs {UNQUANTIZED}** | +30.00 ± 0.00 |" in md


def test_a_failed_information_configuration_cannot_fail_the_run(tmp_path, monkeypatch):
    plan = make_plan(od_config=INT8, vs_unquantized=True, repeats=1)
    _, res = run(plan, tmp_path / "out", monkeypatch, {**QUANT, "crash_start": [UNQUANTIZED]})
    cfg = next(c for c in res["configs"] if c["id"] == UNQUANTIZED)
    assert cfg["status"] == "failed"
    assert res["verdict"]["result"] == "PASS", res["verdict"]
    info = res["information"]["vs_unquantized"]
    assert info["status"].startswith("not measured") and info["time"] is None
    assert "Not measured: configuration stock_unquantized failed" in (tmp_path / "out" / "report.md").read_text()


def test_the_int8_workload_opts_in_and_the_cli_flag_needs_a_quantization(capsys):
    wl = load_workload("qwen-image-910b1-int8")
    assert wl.vs_unquantized is True and wl.od_config == {"quantization_config": "int8"}
    assert cli.main(["plan", "--workload", "qwen-image-910b1-int8"]) == 0
    out = capsys.readouterr().out
    assert f"{UNQUANTIZED:<24} {INFORMATION:<14} none (od_config without quantization_config" in out
    assert cli.main(["plan", "--workload", "qwen-image-910b1-int8", "--no-vs-unquantized"]) == 0
    assert UNQUANTIZED not in capsys.readouterr().out
    assert cli.main(["plan", "--workload", "qwen-image-910b1", "--vs-unquantized"]) == 2
    assert "vs_unquantized" in capsys.readouterr().err
