"""Equivalence tiers ``exact`` / ``pixel`` / ``close``: each optimization's tier here, and the ablation runner's
gate by the weakest tier that differs."""

from __future__ import annotations

import numpy as np

from vllm_omni_ascend_opt import api, optimization
from vllm_omni_ascend_opt.ablation import compare, stats
from vllm_omni_ascend_opt.ablation.plan import OptInfo, build_plan, opt_infos_from_registry
from vllm_omni_ascend_opt.ablation.workload import from_mapping


def _img(delta: float = 0.0) -> compare.StoredImage:
    rng = np.random.default_rng(0)
    # values away from the uint8 rounding boundaries, so a tiny float change keeps the 8-bit image
    base = ((np.round(rng.uniform(0, 255, (3, 16, 16))) / 255.0) * 2.0 - 1.0).astype(np.float32)
    out = base + np.float32(delta)
    return compare.StoredImage(compare.to_uint8(out), out)


def test_weakest_tier_orders_exact_pixel_close():
    assert optimization.TIERS == ("exact", "pixel", "close")
    assert optimization.weakest_tier([]) == "exact"
    assert optimization.weakest_tier(["exact", "pixel"]) == "pixel"
    assert optimization.weakest_tier(["pixel", "close", "exact"]) == "close"


def test_gates_per_tier_on_pixel_identical_but_not_bitwise_images():
    agg = compare.aggregate({"s": compare.compare(_img(), _img(1e-4))})
    assert agg["pixel_identical"] and agg["bitwise_identical"] is False
    exact, pixel = compare.gate(agg, "exact", 0.99, 35), compare.gate(agg, "pixel", 0.99, 35)
    assert exact["passed"] is False and "would pass the pixel tier" in exact["why"]
    assert pixel["passed"] is True and pixel["class"] == "pixel"
    assert compare.gate(agg, "close", 0.99, 35)["passed"] is True
    same = compare.aggregate({"s": compare.compare(_img(), _img())})
    assert compare.gate(same, "exact", 0.99, 35)["why"] == "bitwise-identical"
    off = compare.aggregate({"s": compare.compare(_img(), _img(0.05))})
    assert compare.gate(off, "pixel", 0.99, 35)["passed"] is False
    uint8_only = compare.aggregate({"s": compare.compare(compare.StoredImage(_img().uint8, None), _img())})
    assert compare.gate(uint8_only, "exact", 0.99, 35)["passed"] is True  # no float output: pixel identity


def test_configuration_is_gated_by_the_weakest_tier_it_contains(tmp_path):
    infos = [OptInfo("e", "exact"), OptInfo("p", "pixel"), OptInfo("c", "close")]
    plan = build_plan(from_mapping({"seeds": [1], "repeats": 1, "warmup": 0}).validate(), infos)
    assert stats.compare_configs(plan, tmp_path, "full", "loo_e")["class"] == "exact"  # they differ by e
    assert stats.compare_configs(plan, tmp_path, "loo_c", "stock")["class"] == "pixel"  # by e and p
    assert stats.compare_configs(plan, tmp_path, "loo_e", "stock")["class"] == "close"  # by p and c


def test_tier_here_reaches_list_status_and_the_ablation_plan(fake_npu):
    rows = {r["name"]: r for r in api.status()}
    assert rows["rope"]["tier"] == "exact" and rows["rope"]["equivalence"] == "pixel"  # CPU: portable path
    assert {i.name: i.equivalence for i in opt_infos_from_registry()}["rope"] == "exact"
    fake_npu()
    rows = {r["name"]: r for r in api.status()}
    assert rows["rope"]["tier"] == "pixel" and rows["fused_attention"]["tier"] == "close"
    assert {i.name: i.equivalence for i in opt_infos_from_registry()}["rope"] == "pixel"
    assert all(r["tier"] in optimization.TIERS for r in rows.values())
