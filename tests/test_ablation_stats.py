"""Ablation logic without processes: workloads, plans, statistics, verdicts and gates on synthetic data."""

from __future__ import annotations

import json
import math
import re
import statistics

import numpy as np
import pytest

from vllm_omni_ascend_opt import registry
from vllm_omni_ascend_opt.ablation import compare, report, stats, verdict
from vllm_omni_ascend_opt.ablation.plan import OptInfo, build_plan, estimate, opt_infos_from_registry
from vllm_omni_ascend_opt.ablation.workload import (
    Workload,
    WorkloadError,
    from_mapping,
    load_workload,
    parse_toml,
)

INFOS = [
    OptInfo("a", "exact"),
    OptInfo("b", "exact"),
    OptInfo("c", "close"),
    OptInfo("npu_only", "close", reasons_inactive=("torch_npu is not installed",)),
    OptInfo("approx", "close", default_enabled=False),
]


def wl(**kw) -> Workload:
    return from_mapping({"seeds": [1, 2], "repeats": 3, "warmup": 0, **kw}).validate()


# ----------------------------------------------------------------------------------------------------------------
# workloads
# ----------------------------------------------------------------------------------------------------------------
def test_named_workloads_ship_and_match_the_reference():
    ref = load_workload("qwen-image-910b1")
    assert (ref.dtype, ref.width, ref.height, ref.steps, ref.cfg_scale) == ("bfloat16", 1280, 704, 8, 1.0)
    assert ref.seeds == [42, 43, 44] and ref.warmup == 2 and ref.enforce_eager is True
    tiny = load_workload("tiny-cpu")
    assert tiny.model == "tiny-deep" and tiny.mode == "leave-one-out"  # issue 21: 12 blocks
    tiny.validate()
    ref.validate()
    offload, tiled = load_workload("tiny-cpu-offload"), load_workload("tiny-cpu-tiled")
    assert offload.od_config == {"enable_layerwise_offload": True} and offload.engine == "testbed"
    assert tiled.vae_tiling == [32, 32, 24, 24] and tiled.height == tiled.width == 64  # 3x3 tiles of the tiny VAE


def test_workload_lookup_prefers_local_ablations_dir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ablations").mkdir()
    (tmp_path / "ablations" / "tiny-cpu.json").write_text(json.dumps({"steps": 3, "seeds": [7]}))
    got = load_workload("tiny-cpu")
    assert got.steps == 3 and got.seeds == [7]
    with pytest.raises(WorkloadError, match=r"no workload named 'nope'.*tiny-cpu"):
        load_workload("nope")


def test_toml_workload_values():
    text = (
        '# comment\nname = "x"  # trailing\nseeds = [1, 2, 3]\nprompts = ["a, b", "c # not a comment"]\n'
        "cfg_scale = 4.0\nsteps = 1_000\nenforce_eager = false\n"
    )
    assert parse_toml(text) == {
        "name": "x",
        "seeds": [1, 2, 3],
        "prompts": ["a, b", "c # not a comment"],
        "cfg_scale": 4.0,
        "steps": 1000,
        "enforce_eager": False,
    }


@pytest.mark.parametrize(
    "bad, msg",
    [
        (dict(height=30), "multiple of 16"),
        (dict(seeds=[1, 1]), "distinct"),
        (dict(repeats=0), "repeats"),
        (dict(mode="random"), "mode"),
        (dict(cfg_scale=0.5), "cfg_scale"),
        (dict(ssim_gate=1.5), "SSIM gate"),
        (dict(stepz=3), "unknown key"),
        (
            dict(od_config={"enable_layerwise_ofload": True}),
            "OmniDiffusionConfig has no field(s) enable_layerwise_ofload",
        ),
        (dict(od_config=["enable_layerwise_offload"]), "od_config must be a table"),
        (dict(vae_tiling=[32, 32, 24]), "vae_tiling must be"),
        (dict(vae_tiling=[32, 32, 24, 20]), "vae_tiling must be"),
        (dict(vae_decode_repeats=0), "vae_decode_repeats must be >= 1"),
    ],
)
def test_bad_workload_values_are_named(bad, msg):
    with pytest.raises(WorkloadError, match=re.escape(msg)):
        wl(**bad)


# ----------------------------------------------------------------------------------------------------------------
# plans
# ----------------------------------------------------------------------------------------------------------------
def test_leave_one_out_plan_lists_inactive_and_default_off_as_skipped():
    plan = build_plan(wl(), INFOS)
    assert plan.stack == ["a", "b", "c"]
    assert plan.skipped["npu_only"] == ["torch_npu is not installed"]
    assert "off by default" in plan.skipped["approx"][0]
    ids = [c.id for c in plan.configs]
    assert ids == ["stock", "full", "loo_a", "loo_b", "loo_c", "full_ctrl"]
    assert plan.config("loo_b").spec == "none,+a,+c"
    assert plan.config("full_ctrl").opts == plan.config("full").opts
    assert [(c.opt, c.with_, c.without) for c in plan.comparisons] == [
        ("a", "full", "loo_a"),
        ("b", "full", "loo_b"),
        ("c", "full", "loo_c"),
    ]
    assert plan.engine == "testbed" and plan.schedule == "resident"


def test_cumulative_and_single_plans_follow_order_and_merge_duplicates():
    plan = build_plan(wl(mode="cumulative"), INFOS, order=["c", "a"])
    assert plan.stack == ["c", "a", "b"]
    assert [(c.opt, c.with_, c.without) for c in plan.comparisons] == [
        ("c", "cum1_c", "stock"),
        ("a", "cum2_a", "cum1_c"),
        ("b", "full", "cum2_a"),  # the last prefix is the full stack: one configuration, not two
    ]
    single = build_plan(wl(mode="single"), INFOS, only=["a"])
    # one optimization: stock + a == full, so the plan is stock, full and the control
    assert [c.id for c in single.configs] == ["stock", "full", "full_ctrl"]
    assert [(c.with_, c.without) for c in single.comparisons] == [("full", "stock")]


def test_only_skip_stack_and_bad_names():
    plan = build_plan(wl(stack="all"), INFOS, skip=["b"])
    assert plan.stack == ["a", "c", "approx"] and plan.skipped["b"] == ["excluded by --skip"]
    plan = build_plan(wl(), INFOS, only=["approx"])  # named explicitly: takes part although default-off
    assert plan.stack == ["approx"]
    with pytest.raises(WorkloadError, match=r"unknown optimization 'zz'.*valid names: a, b, c"):
        build_plan(wl(), INFOS, only=["zz"])
    with pytest.raises(WorkloadError, match="cannot take part"):
        build_plan(wl(mode="cumulative"), INFOS, order=["npu_only"])
    empty = build_plan(wl(), INFOS, only=["npu_only"])
    assert empty.stack == [] and [c.id for c in empty.configs] == ["stock"]


def test_fingerprint_ignores_presentation_but_not_measurement():
    a = build_plan(wl(), INFOS).fingerprint()
    assert build_plan(wl(psnr_gate=40.0, name="other"), INFOS).fingerprint() == a
    assert build_plan(wl(steps=5), INFOS).fingerprint() != a
    assert build_plan(wl(), INFOS, skip=["c"]).fingerprint() != a


def test_estimate_counts_processes_and_generations():
    plan = build_plan(wl(warmup=2, repeats=3, seeds=[1, 2]), INFOS)  # 6 configurations
    e = estimate(plan)
    assert (e.processes, e.measured, e.generations) == (6, 6 * 3 * 2, 6 * 2 + 36)
    per_round = build_plan(wl(warmup=2, repeats=3, seeds=[1, 2], schedule="per-round"), INFOS)
    e2 = estimate(per_round)
    assert e2.processes == 18 and e2.generations == 18 * 2 + 36 and e2.seconds > e.seconds


# ----------------------------------------------------------------------------------------------------------------
# statistics
# ----------------------------------------------------------------------------------------------------------------
def records(plan, times: dict[str, list[list[float]]]) -> list[dict]:
    """times[config][round] = one total per sample, in plan.samples order."""
    out = []
    for cid, rounds in times.items():
        for r, vals in enumerate(rounds):
            for (p, s), v in zip(plan.samples, vals, strict=True):
                out.append(
                    {
                        "type": "sample",
                        "config": cid,
                        "round": r,
                        "prompt": p,
                        "seed": s,
                        "warmup": False,
                        "total_ms": v,
                        "stages_ms": {"denoise": v * 0.5},
                    }
                )
    return out


def test_round_statistic_median_resists_a_stray_spike_and_mean_does_not():
    plan = build_plan(wl(seeds=[1, 2, 3], repeats=1), INFOS)
    recs = records(plan, {"stock": [[100.0, 101.0, 900.0]]})
    assert stats.round_means(plan, recs)["stock"][0]["total"] == 101.0
    plan_mean = build_plan(wl(seeds=[1, 2, 3], repeats=1, round_stat="mean"), INFOS)
    assert stats.round_means(plan_mean, recs)["stock"][0]["total"] == pytest.approx(367.0)
    # an incomplete round does not count
    assert "stock" not in stats.round_means(plan, recs[:2])


def test_pair_noise_floor_labels_and_sign_flips():
    means = {
        "full": {0: {"total": 100.0}, 1: {"total": 102.0}, 2: {"total": 101.0}},
        "full_ctrl": {0: {"total": 101.0}, 1: {"total": 100.0}, 2: {"total": 101.5}},
        "loo_a": {0: {"total": 110.0}, 1: {"total": 111.0}, 2: {"total": 112.0}},  # clear gain
        "loo_b": {0: {"total": 101.5}, 1: {"total": 103.5}, 2: {"total": 102.5}},  # +1.5 each: inside noise
        "loo_c": {0: {"total": 90.0}, 1: {"total": 92.0}, 2: {"total": 91.0}},  # clear regression
        "loo_d": {0: {"total": 110.0}, 1: {"total": 95.0}, 2: {"total": 120.0}},  # big mean, flips sign
    }
    nf = stats.noise_floor(means)
    ctrl = [1.0, -2.0, 0.5]
    assert nf["per_round_ms"] == ctrl
    assert nf["ms"] == pytest.approx(abs(sum(ctrl) / 3) + 2 * statistics.stdev(ctrl) / math.sqrt(3))
    res = {}
    for k in ("loo_a", "loo_b", "loo_c", "loo_d"):
        p = stats.pair(means, k, "full")
        res[k] = (stats.direction(p["per_round_ms"]), stats.label(p["per_round_ms"], p["mean_ms"], nf["ms"]))
    assert res == {
        "loo_a": ("consistent", "gain"),
        "loo_b": ("consistent", "within noise"),
        "loo_c": ("consistent", "regression"),
        "loo_d": ("flips", "within noise"),
    }
    p = stats.pair(means, "loo_a", "full")
    assert p["per_round_ms"] == [10.0, 9.0, 11.0] and p["mean_ms"] == 10.0 and p["std_ms"] == pytest.approx(1.0)
    # many rounds: one stray round flips the direction but does not hide a clear, repeated saving
    many = [5.0] * 7 + [-1.0]
    assert stats.direction(many) == "flips" and stats.label(many, sum(many) / 8, 1.0) == "gain"
    # one round: the noise floor alone decides
    assert stats.label([3.0], 3.0, 2.0) == "gain" and stats.label([1.0], 1.0, 2.0) == "within noise"
    assert stats.noise_floor({"full": {0: {"total": 10.0}}, "full_ctrl": {0: {"total": 13.0}}})["ms"] == 3.0
    assert stats.label([], None, 1.0) == "not measured"
    assert stats.label([5.0], 5.0, None) == "no noise floor"


# ----------------------------------------------------------------------------------------------------------------
# equivalence
# ----------------------------------------------------------------------------------------------------------------
def _img(seed=0, amp=0.0):
    rng = np.random.default_rng(seed)
    base = np.tanh(rng.standard_normal((3, 32, 32))).astype(np.float32)
    if amp:
        base = np.clip(base + amp * np.random.default_rng(99).standard_normal(base.shape), -1, 1).astype(np.float32)
    return compare.StoredImage(compare.to_uint8(base), base)


def test_gates_on_identical_images_and_small_and_large_perturbations():
    m = compare.compare(_img(), _img())  # identical: infinite PSNR, both classes pass
    assert m["pixel_identical"] and m["bitwise_identical"] and m["ssim"] == 1.0 and math.isinf(m["psnr_db"])
    agg = compare.aggregate({"s": m})
    assert compare.gate(agg, "exact", 0.99, 35)["passed"] and compare.gate(agg, "close", 0.99, 35)["passed"]
    small = compare.aggregate({"s": compare.compare(_img(), _img(amp=0.004))})
    big = compare.aggregate({"s": compare.compare(_img(), _img(amp=0.2))})
    assert small["pixel_identical"] is False and small["max_abs_diff"] > 0  # a real, small change
    assert small["ssim_min"] >= 0.99 and small["psnr_db_min"] >= 35  # well inside the close gates
    assert compare.gate(small, "close", 0.99, 35)["passed"] is True
    assert compare.gate(small, "exact", 0.99, 35)["passed"] is False  # just beyond the exact boundary
    assert compare.gate(big, "close", 0.99, 35)["passed"] is False
    assert compare.gate(big, "exact", 0.99, 35)["passed"] is False
    assert "SSIM" in compare.gate(big, "close", 0.99, 35)["why"]
    # uint8-only images (the Omni engine returns PIL images): no float output, basis uint8
    u = compare.compare(compare.StoredImage(_img().uint8, None), compare.StoredImage(_img(amp=0.2).uint8, None))
    assert u["basis"] == "uint8" and u["bitwise_identical"] is None and u["psnr_db"] < 35
    assert compare.gate({}, "exact", 0.99, 35)["passed"] is None


def test_exact_gate_fails_on_one_changed_pixel_value_that_the_close_gate_accepts():
    """The smallest change there is: one channel of one pixel off by one 8-bit level."""
    ref = _img()
    u8 = ref.uint8.copy()
    u8[0, 0, 0] = u8[0, 0, 0] + 1 if u8[0, 0, 0] < 255 else 254
    one = compare.StoredImage(u8, None)
    agg = compare.aggregate({"s": compare.compare(compare.StoredImage(ref.uint8, None), one)})
    assert agg["pixel_identical"] is False and agg["ssim_min"] > 0.999 and agg["psnr_db_min"] > 60
    exact, close = compare.gate(agg, "exact", 0.99, 35), compare.gate(agg, "close", 0.99, 35)
    assert exact["passed"] is False and "not pixel-identical" in exact["why"]
    assert close["passed"] is True


@pytest.mark.parametrize(
    "ssim, psnr, passed",
    [(0.995, 36.0, True), (0.995, 34.9, False), (0.989, 50.0, False), (0.99, 35.0, True)],
    ids=["both_pass", "psnr_fails", "ssim_fails", "at_the_gates"],
)
def test_close_gate_needs_both_ssim_and_psnr(ssim, psnr, passed):
    agg = {"pixel_identical": False, "bitwise_identical": False, "max_abs_diff": 0.1, "ssim_min": ssim}
    agg["psnr_db_min"] = psnr
    assert compare.gate(agg, "close", 0.99, 35)["passed"] is passed


def _verdict(plan, *, full_saved=10.0, noise=1.0, opt_label="gain", gate_ok=True, status="ok", busy=False):
    configs = [
        {
            "id": "full",
            "status": status,
            "error": "boom" if status == "failed" else None,
            "rounds_complete": [0, 1, 2],
            "vs_stock": None,
            "vs_full": None,
        }
    ]
    chk = {"gate": {"class": "exact", "passed": gate_ok, "why": "pixel-identical" if gate_ok else "differs"}}
    opts = [
        {
            "name": "a",
            "equivalence": "exact",
            "label": opt_label,
            "equivalence_check": chk,
            "saved_ms": {"mean": 3.0, "std": 0.1, "per_round": [3.0]},
            "saved_pct_of_stock": 3.0,
        }
    ]
    fvs = {
        "saved_ms": {"mean": full_saved, "std": 0.5, "per_round": [full_saved] * 3},
        "saved_pct_of_stock": full_saved,
        "label": stats.label([full_saved] * 3, full_saved, noise),
    }
    nf = {"ms": noise}
    load = {"load1_max": 9.0, "cpu_count": 2, "others_cpu_median": 1.5, "busy": busy}
    return verdict.decide(plan, configs, opts, fvs, nf, load=load)


def test_exit_codes():
    plan = build_plan(wl(min_improvement_pct=1.0), INFOS)
    assert _verdict(plan)["result"] == "PASS" and _verdict(plan)["exit_code"] == 0
    v = _verdict(plan, gate_ok=False)
    assert v["result"] == "FAIL" and v["exit_code"] == 1 and "gate failed" in v["reasons"][0]
    assert _verdict(plan, opt_label="regression")["result"] == "FAIL"
    assert _verdict(plan, status="failed")["result"] == "FAIL"
    v = _verdict(plan, full_saved=0.5, noise=1.0)  # inside the noise floor
    assert v["result"] == "INCONCLUSIVE" and v["exit_code"] == 2 and "within noise" in v["reasons"][0]
    v = _verdict(plan, full_saved=0.5, noise=0.1)  # a real gain, but below --min-improvement-pct
    assert v["result"] == "FAIL" and "less than --min-improvement-pct" in v["reasons"][0]
    v = _verdict(plan, full_saved=-5.0, noise=1.0)
    assert v["result"] == "FAIL" and "slower than stock" in v["reasons"][0]
    # measured on a busy machine: timing failures are not trusted, gate failures still are
    v = _verdict(plan, full_saved=-5.0, noise=1.0, busy=True)
    assert v["result"] == "INCONCLUSIVE" and "busy" in v["reasons"][0]
    assert _verdict(plan, gate_ok=False, busy=True)["result"] == "FAIL"
    assert _verdict(plan, busy=True)["result"] == "PASS"


def test_machine_load_summary():
    ready = {"type": "ready", "env": {"device": {"torch_threads": 1}}}
    recs = [
        {"type": "sample", "warmup": False, "total_ms": 20.0, "cpu_ms": 10.0, "load1": x, "others_cpu": o}
        for x, o in ((0.5, 1.6), (3.5, 1.7), (3.0, 0.1))
    ]
    m = stats.machine_load([ready, *recs], cpu_count=2)
    # one thread per worker on 2 CPUs leaves 1 core free: others using 1.6 cores (median) is contention
    assert m["busy"] and m["others_cpu_threshold"] == 1.25 and m["others_cpu_median"] == 1.6
    assert m["load1_max"] == 3.5 and m["wall_over_cpu_median"] == 2.0
    # a high load average alone (e.g. the run's own workers starting) is not contention
    quiet = [{**r, "others_cpu": 0.2} for r in recs]
    assert not stats.machine_load([ready, *quiet], cpu_count=2)["busy"]
    # workers using every core: half a core of other work is already contention
    all_threads = {"type": "ready", "env": {"device": {"torch_threads": 2}}}
    some = [{**r, "others_cpu": o} for r, o in zip(recs, (0.6, 0.7, 0.2), strict=True)]
    assert stats.machine_load([all_threads, *some], cpu_count=2)["busy"]
    assert stats.machine_load(recs[:0], cpu_count=2)["busy"] is False


def test_peak_memory_per_configuration_ratios_and_report_table():
    """The worker's probe (one per ready event) becomes each configuration's peaks: the largest over its workers, a
    ratio to stock's from the same run, and a report table; engines that measure nothing leave no table."""

    def ready(fwd: int, vae: int) -> dict:
        return {
            "type": "ready",
            "memory": {"transformer_forward": {"peak": fwd, "end": 0}, "vae_decode": {"peak": vae, "end": 1}},
        }

    mib = 2**20
    assert stats.peak_memory([{"type": "ready", "memory": None}]) is None  # omni / serve engines
    assert stats.peak_memory([{"memory": {"error": "boom"}}]) == {"error": "boom"}
    configs = [
        {"id": "stock", "memory": stats.peak_memory([ready(100 * mib, 40 * mib), ready(90 * mib, 40 * mib)])},
        {"id": "full", "memory": stats.peak_memory([ready(80 * mib, 20 * mib)])},
        {"id": "other", "memory": None},
    ]
    assert configs[0]["memory"]["transformer_forward"] == {"peak": 100 * mib, "end": 0}  # the largest over workers
    stats.add_memory_ratios(configs)
    assert configs[1]["memory"]["transformer_forward"]["vs_stock"] == 0.8
    assert configs[1]["memory"]["vae_decode"]["vs_stock"] == 0.5
    assert configs[0]["memory"]["vae_decode"]["vs_stock"] == 1.0
    lines = report.memory_section(configs)
    assert "## Peak memory" in lines
    assert "| `full` | 80.00 (0.800×) | 20.00 (0.500×) |" in lines
    assert not any("`other`" in line for line in lines)
    assert report.memory_section([{"id": "stock", "memory": None}]) == []


def test_an_optimization_that_needs_a_vllm_omni_mode_takes_part_only_where_the_workload_sets_it():
    """Optimization.needs_config (memo_aware_offload: layerwise offload): skipped, with the reason, in a workload
    whose od_config does not set the mode; in the stack (and left out with what it needs) where it does."""
    infos = [*INFOS[:3], OptInfo("offl", "exact", needs=("a",), needs_config=(("enable_layerwise_offload", True),))]
    plan = build_plan(wl(), infos)
    assert "offl" not in plan.stack
    assert plan.skipped["offl"] == [
        "acts only with enable_layerwise_offload=True (a vLLM-Omni mode this workload's od_config does not set)"
    ]
    plan = build_plan(wl(od_config={"enable_layerwise_offload": True}), infos)
    assert plan.stack == ["a", "b", "c", "offl"] and "offl" not in plan.skipped
    assert "offl" not in plan.config("loo_a").opts  # it acts through a


def test_stages_come_from_the_registry():
    """Transformer optimizations change denoise, VAE ones vae_decode; the planner takes them from the registry."""
    infos = {i.name: i.stages for i in opt_infos_from_registry()}
    for opt in registry.all_optimizations():
        want = ("vae_decode",) if "vae" in opt.regions else ("denoise",)
        assert infos[opt.name] == opt.changed_stages() == want, opt.name
    plan = build_plan(wl(), [OptInfo("t", "exact", stages=("denoise",)), OptInfo("v", "exact", stages=("vae_decode",))])
    assert plan.stages_of({"t", "v"}) == ("denoise", "vae_decode") and plan.stages_of({"v"}) == ("vae_decode",)
    assert OptInfo("unknown", "exact").stages == ("text_encode", "denoise", "vae_decode")  # unknown: the total


def test_staged_comparison_measures_own_stages_and_flags_control_bias():
    def row(te, dn, vd):
        return {"total": te + dn + vd, "text_encode": te, "denoise": dn, "vae_decode": vd}

    means = {
        "full": {0: row(5, 50, 20), 1: row(5.1, 50, 20)},
        "full_ctrl": {0: row(5.1, 50.5, 20), 1: row(5, 49.5, 20.2)},
        "loo_t": {0: row(5, 60, 20), 1: row(5.05, 60.5, 20)},  # saves 10 ms of denoise, control equal
        "loo_fast": {0: row(2, 60, 20), 1: row(2.1, 60.5, 20)},  # the same, in a process 3 ms faster at text encode
    }
    ok = stats.staged(means, "loo_t", "full", ("denoise",))
    assert ok["basis"] == ["denoise"] and ok["label"] == stats.GAIN and not ok["control"]["bias"]
    bad = stats.staged(means, "loo_fast", "full", ("denoise",))
    assert bad["label"] == stats.BIAS and bad["control"]["diff_ms"] == pytest.approx(-3.0)
    # every stage: on the total, no control; missing stage data: on the total too
    assert stats.staged(means, "loo_t", "full", stats.STAGES)["basis"] == ["total"]
    bare = {k: {r: {"total": v["total"]} for r, v in rows.items()} for k, rows in means.items()}
    assert stats.staged(bare, "loo_fast", "full", ("denoise",))["control"] is None
