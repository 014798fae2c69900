"""The 910B1 estimate (``ablation/estimate.py``): launches saved x a per-launch cost calibrated on the reference; the
table against the NPU counter, the arithmetic by hand, and ``plan``'s output (tiny workload: tests/test_ablation_cli.py).
"""

from __future__ import annotations

import json

import pytest
import torch

from vllm_omni_ascend_opt.ablation import estimate
from vllm_omni_ascend_opt.cli import main
from vllm_omni_ascend_opt.testbed import blockops

BF16 = torch.bfloat16


def _entry(*opts: str) -> dict[str, int]:
    return estimate.load_table()["entries"][estimate.key(opts)]


def _per_call(*opts: str) -> int:
    e = _entry(*opts)
    return 60 * e["block"] + e["outside"]


def test_table_covers_every_transformer_optimization():
    table = estimate.load_table()
    names = estimate.transformer_opts()
    assert table["transformer_opts"] == names, "new optimization: run benchmarks/bench_ops.py --write-table"
    assert len(table["entries"]) == 2 ** len(names)
    assert "vae_exact" not in names  # the VAE optimizations patch no transformer module
    assert estimate.key(("vae_exact", "rope")) == estimate.key(("rope",)) == "rope"


def test_table_is_current_with_the_counter(runtime, fake_npu):
    fake_npu()
    tr = blockops.build_transformer(runtime, blockops.TINY, BF16)
    kw = blockops.t2i_inputs(tr, BF16)
    names = estimate.transformer_opts()
    for opts in [(), tuple(names), *((n,) for n in names)]:
        flags = ",".join(["none", *(f"+{n}" for n in opts)])
        got = blockops.count_block(tr, runtime, kw, flags, npu=True)
        assert got.total == _entry(*opts)["block"], (flags, "run benchmarks/bench_ops.py --write-table")


def test_calibration_on_the_reference_rope_and_modulation_figures():
    cal = estimate.calibration()
    rope_saved, mod_saved = _per_call() - _per_call("rope"), _per_call() - _per_call("shared_modulation")
    assert cal.rope_saved_per_call == rope_saved and cal.modulation_saved_per_call == mod_saved
    assert cal.us_rope == pytest.approx(194.0e3 / (8 * rope_saved))
    assert cal.us_modulation == pytest.approx(255.0e3 / (8 * mod_saved))
    assert cal.used == "rope" and cal.us_per_launch == cal.us_rope
    assert 10 < cal.us_rope < 15  # the order of magnitude: ~30 launches per block x 480 for 194 ms
    assert cal.us_modulation > cal.us_rope  # modulation sharing also saves weight reads
    assert "194 ms" in cal.describe() and "255 ms" in cal.describe()


def test_ms_saved_is_launches_saved_times_60_blocks_steps_cfg_and_cost():
    us = 194.0e3 / (8 * (_per_call() - _per_call("rope")))
    names = estimate.transformer_opts()
    full = tuple(names)
    by_hand = (_per_call() - _per_call(*full)) * 8 * us / 1e3
    assert estimate.ms_saved(full, steps=8) == pytest.approx(by_hand)
    assert estimate.ms_saved(("rope",), steps=8) == pytest.approx(194.0)  # calibrated on it
    assert estimate.ms_saved(full, steps=4) == pytest.approx(by_hand / 2)
    assert estimate.ms_saved(full, steps=8, cfg=True) == pytest.approx(2 * by_hand)
    assert estimate.ms_saved((), steps=8) == 0
    assert estimate.launches_per_call(full) == _per_call(*full)
    assert estimate.launches_per_call(full, blocks=30) < estimate.launches_per_call(full)
    assert estimate.launches(("rope",), {"entries": {}}) is None  # a configuration the table lacks: no estimate


def test_plan_prints_the_estimate_for_the_910b1_workload(capsys, tmp_path):
    assert main(["plan", "--workload", "qwen-image-910b1", "--out", str(tmp_path / "o")]) == 0
    out = " ".join(capsys.readouterr().out.split())  # wrapped lines joined
    assert "estimated ms saved on a 910B1 (model, not measured)" in out
    assert "calibrated on the reference's NPU RoPE figure" in out
    assert "stock" in out and " 0 ms" in out
    assert main(["plan", "--json", "--workload", "qwen-image-910b1", "--out", str(tmp_path / "o")]) == 0
    data = json.loads(capsys.readouterr().out)
    ms = data["launch_estimate"]["ms_saved"]
    assert ms["stock"] == 0
    full = next(c for c in data["plan"]["configs"] if c["id"] == "full")
    assert ms["full"] == pytest.approx(estimate.ms_saved(full["opts"], steps=8))


def test_summary_line_for_benchmark_tables():
    line = estimate.summary({"stock": "none", "rope": "none,+rope", "typo": "none,+no_such_opt"})
    assert line.startswith("estimated ms saved on a 910B1 (model, not measured)")
    assert "stock 0," in line and "rope 194," in line and line.endswith("typo n/a")
