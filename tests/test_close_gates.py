"""Per-optimization ``close`` gates: an optimization's own comparison is held to its gate, a configuration's to the
loosest gate among the close optimizations it differs by (the workload's where none is set). Synthetic metrics."""

from __future__ import annotations

import pytest

from vllm_omni_ascend_opt import registry
from vllm_omni_ascend_opt.ablation import stats, verdict
from vllm_omni_ascend_opt.ablation.plan import OptInfo, build_plan, opt_infos_from_registry
from vllm_omni_ascend_opt.ablation.workload import from_mapping

FAST = (0.999, 45.0)
INFOS = [
    OptInfo("ex", "exact"),
    OptInfo("fast_a", "close", default_enabled=False, close_gates=FAST),
    OptInfo("fast_b", "close", default_enabled=False, close_gates=(0.9995, 50.0)),
    OptInfo("vae", "close", default_enabled=False),  # no own gate: the workload's 0.99 / 35 dB
]


def plan(mode: str = "leave-one-out", infos=INFOS, **kw):
    wl = from_mapping({"seeds": [1], "repeats": 1, "warmup": 0, "mode": mode, "stack": "all"}).validate()
    return build_plan(wl, infos, **kw)


def test_gate_selection_per_difference():
    p = plan()
    assert p.close_gates(["fast_a"]) == {"ssim": 0.999, "psnr_db": 45.0}
    assert p.close_gates(["fast_b"]) == {"ssim": 0.9995, "psnr_db": 50.0}
    assert p.close_gates(["fast_a", "fast_b"]) == {"ssim": 0.999, "psnr_db": 45.0}  # the loosest of the two
    assert p.close_gates(["fast_b", "vae"]) == {"ssim": 0.99, "psnr_db": 35.0}  # vae's is the workload's
    assert p.close_gates(["ex"]) == p.close_gates([]) == {"ssim": 0.99, "psnr_db": 35.0}
    assert p.close_gates(["ex", "fast_b"]) == {"ssim": 0.9995, "psnr_db": 50.0}  # exact ones bring no gate
    d = p.to_dict()["optimizations"]
    assert d["fast_a"]["close_gates"] == {"ssim": 0.999, "psnr_db": 45.0} and d["ex"]["close_gates"] is None


def test_registry_fast_tier_declares_its_gates():
    infos = {i.name: i for i in opt_infos_from_registry()}
    for name in ("fast_modulate", "fast_residual"):
        opt = registry.get(name)
        assert opt.close_gates == FAST and opt.equivalence == "close" and not opt.default_enabled
        assert infos[name].close_gates == FAST
    assert infos["vae_fast"].close_gates is None  # the workload's gates, as before
    assert infos["fast_residual"].needs == ("shared_modulation",)  # never planned without it
    wl = from_mapping({"seeds": [1], "repeats": 1, "warmup": 0, "stack": "all"}).validate()
    for c in build_plan(wl, list(infos.values())).configs:
        assert not ({"fast_modulate", "fast_residual"} & set(c.opts)) or "shared_modulation" in c.opts, c


def _analyse(monkeypatch, tmp_path, p, metrics: dict[str, tuple[float, float]]):
    """``analyse`` with ``metrics[other config] = (SSIM, PSNR)`` as every image comparison's result."""

    def cmp(ref, other):
        ssim, psnr = metrics.get(other, (1.0, float("inf")))
        same = ssim == 1.0
        return {
            "pixel_identical": same,
            "bitwise_identical": same,
            "max_abs_diff": 0.0 if same else 0.01,
            "mean_abs_diff": 0.0 if same else 0.001,
            "ssim": ssim,
            "psnr_db": psnr,
            "basis": "float",
        }

    monkeypatch.setattr(stats.compare, "load_stored", lambda stem: stem.parent.name)
    monkeypatch.setattr(stats.compare, "compare", cmp)
    return verdict.analyse(p, [], tmp_path)


@pytest.mark.parametrize(
    "ssim, psnr, passed",
    [(0.9991, 45.1, True), (0.9989, 60.0, False), (0.9999, 44.9, False)],
    ids=["inside", "ssim_just_below", "psnr_just_below"],
)
def test_each_optimization_is_held_to_its_own_gate(monkeypatch, tmp_path, ssim, psnr, passed):
    """leave-one-out: fast_a's verdict compares full with loo_fast_a; 0.9989 would pass the workload's 0.99."""
    p = plan()
    out = _analyse(monkeypatch, tmp_path, p, {"full": (ssim, psnr)})
    chk = {o["name"]: o["equivalence_check"] for o in out["optimizations"]}
    assert chk["fast_a"]["gates"] == {"ssim": 0.999, "psnr_db": 45.0}
    assert chk["fast_a"]["gate"]["passed"] is passed
    assert chk["vae"]["gates"] == {"ssim": 0.99, "psnr_db": 35.0} and chk["vae"]["gate"]["passed"] is True


@pytest.mark.parametrize(
    "ssim, psnr, loosest, alone",
    [(0.9991, 45.1, True, True), (0.9989, 45.1, True, False), (0.9894, 45.1, False, False)],
    ids=["inside_both", "loosest_only", "beyond_the_loosest"],
)
def test_a_configuration_is_held_to_the_loosest_gate_it_contains(monkeypatch, tmp_path, ssim, psnr, loosest, alone):
    """single_fast_a vs stock differs by fast_a alone; full vs stock by all three, loosest vae's (the workload's)."""
    p = plan("single")
    out = _analyse(monkeypatch, tmp_path, p, {"full": (ssim, psnr), "single_fast_a": (ssim, psnr)})
    cfg = {c["id"]: c for c in out["configs"]}
    assert cfg["full"]["vs_stock"]["gates"] == {"ssim": 0.99, "psnr_db": 35.0}
    assert cfg["full"]["vs_stock"]["gate"]["passed"] is loosest
    assert cfg["single_fast_a"]["vs_stock"]["gates"] == {"ssim": 0.999, "psnr_db": 45.0}
    assert cfg["single_fast_a"]["vs_stock"]["gate"]["passed"] is alone


# optimizations that act through another (Optimization.needs): never planned without it
NEEDS = [
    OptInfo("memo", "exact"),
    OptInfo("ex", "exact"),
    OptInfo("fast", "close", default_enabled=False, close_gates=FAST, needs=("memo",)),
]


def test_leave_one_out_of_a_needed_optimization_leaves_out_its_dependents(monkeypatch, tmp_path):
    p = plan("leave-one-out", NEEDS)
    assert p.config("loo_memo").opts == ("ex",) and "fast, which need it" in p.config("loo_memo").label
    assert p.config("loo_fast").opts == ("memo", "ex")
    # memo's verdict compares full with full - memo - fast: held to the close class and fast's gate
    out = _analyse(monkeypatch, tmp_path, p, {"full": (0.9991, 45.1)})
    chk = {o["name"]: o["equivalence_check"] for o in out["optimizations"]}
    assert chk["memo"]["class"] == "close" and chk["memo"]["gates"] == {"ssim": 0.999, "psnr_db": 45.0}
    assert chk["memo"]["gate"]["passed"] is True and chk["ex"]["class"] == "exact"


def test_single_and_cumulative_keep_what_an_optimization_needs_and_a_need_that_cannot_take_part_skips():
    p = plan("single", NEEDS)
    assert p.config("single_fast").opts == ("memo", "fast")
    comp = {c.opt: c for c in p.comparisons}
    assert comp["fast"].without == "single_memo" and comp["memo"].without == "stock"  # fast vs memo alone
    p = plan("cumulative", NEEDS)
    assert [p.config(c.with_).opts for c in p.comparisons][-1] == ("memo", "ex", "fast")
    with pytest.raises(Exception, match="puts fast before memo, which it needs"):
        plan("cumulative", NEEDS, order=["fast", "memo"])
    infos = [OptInfo("memo", "exact", reasons_inactive=("broken",)), *NEEDS[1:]]
    p = plan("leave-one-out", infos)
    assert p.stack == ["ex"] and p.skipped["fast"] == ["needs memo, which cannot take part in this run"]
    p = plan("leave-one-out", NEEDS, skip=["memo"])
    assert "fast" not in p.stack and "needs memo" in p.skipped["fast"][0]


def test_tiny_cpu_fast_workload_holds_the_fast_tier_to_its_gates_against_stock():
    from vllm_omni_ascend_opt.ablation.workload import load_workload

    wl = load_workload("tiny-cpu-fast").validate()
    assert wl.model == "tiny-deep" and wl.mode == "leave-one-out" and wl.stack == "all" and wl.engine == "testbed"
    p = build_plan(wl, opt_infos_from_registry())
    assert {"shared_modulation", "fast_modulate", "fast_residual", "vae_fast"} <= set(p.stack)
    fast_only = set(p.config("loo_vae_fast").opts)  # the default stack + the fast tier
    assert {"fast_modulate", "fast_residual"} <= fast_only and "vae_fast" not in fast_only
    others = [n for n in fast_only if p.opts[n].equivalence == "close" and p.opts[n].close_gates is None]
    if not others:  # on CPU; with torch_npu, fused_attention / nz_weights (workload gates) join the configuration
        assert p.close_gates(fast_only) == {"ssim": 0.999, "psnr_db": 45.0}
    assert p.close_gates(set(p.config("full").opts)) == {"ssim": 0.99, "psnr_db": 35.0}  # with vae_fast: loosest
