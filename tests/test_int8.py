"""The plugin on top of vLLM-Omni's own NPU int8 (``--quantization int8``, ``tests/harness/int8.py``): results by
tier against int8-stock, what each optimization does there, the modulation memo, launches per block, ignored and
over-wide layers, and ``nz_weights`` on int8 weights.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.fake_torch_npu import formats
from tests.harness import int8 as h
from vllm_omni_ascend_opt import _report, api, registry
from vllm_omni_ascend_opt.ablation.metrics import compare_images, to_uint8
from vllm_omni_ascend_opt.testbed import blockops
from vllm_omni_ascend_opt.testbed.pipeline import generate

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

EXACT = "none,+shared_modulation,+joint_attention,+vae_exact"


def _images(pipe, rt, spec: str) -> torch.Tensor:
    api.select(spec, model=pipe)
    return generate(pipe, rt, steps=2, seed=3).images


def test_fake_quant_kernels_follow_their_documented_semantics_and_constraints(fake_npu):
    npu = fake_npu()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 32, generator=g).bfloat16()
    q, s = npu.npu_dynamic_quant(x)
    assert q.dtype == torch.int8 and s.dtype == torch.float32 and s.shape == (5,)
    assert torch.equal(s, x.float().abs().amax(-1) / 127) and int(q.abs().amax()) == 127
    w = torch.randn(48, 32, generator=g).bfloat16()
    qw, ws = npu.npu_dynamic_quant(w)  # vLLM-Omni's load: per output channel, then stored [k, n]
    qw = qw.t().contiguous()
    b = torch.randn(48, generator=g).bfloat16()
    y = npu.npu_quant_matmul(q, qw, ws, bias=b, pertoken_scale=s, output_dtype=torch.bfloat16)
    acc = (q.long() @ qw.long()).float()
    assert torch.equal(y, (acc * ws * s[:, None] + b.float()).bfloat16())
    assert torch.equal(
        npu.npu_quant_matmul(q, qw, ws, pertoken_scale=s, output_dtype=15), (acc * ws * s[:, None]).bfloat16()
    )
    nz = npu.npu_format_cast(qw, formats.FRACTAL_NZ)
    assert npu.get_npu_format(nz) == formats.FRACTAL_NZ
    assert torch.equal(npu.npu_quant_matmul(q, nz, ws, bias=b, pertoken_scale=s, output_dtype=torch.bfloat16), y)
    bad = [
        lambda: npu.npu_dynamic_quant(x.float()),  # fp16/bf16 only
        lambda: npu.npu_quant_matmul(x, qw, ws, pertoken_scale=s, output_dtype=15),  # x1 not int8
        lambda: npu.npu_quant_matmul(q, qw[:16], ws, pertoken_scale=s, output_dtype=15),  # k mismatch
        lambda: npu.npu_quant_matmul(q, qw, ws[:3], pertoken_scale=s, output_dtype=15),  # scale shape
        lambda: npu.npu_quant_matmul(q, qw, ws.bfloat16(), pertoken_scale=s, output_dtype=5),  # bf16 scale, fp16 out
        lambda: npu.npu_quant_matmul(q, qw, ws, pertoken_scale=s[:2], output_dtype=15),  # pertoken shape
        lambda: npu.npu_quant_matmul(q, qw, ws, bias=b[:3], pertoken_scale=s, output_dtype=15),  # bias shape
        lambda: npu.npu_quant_matmul(q, torch.zeros(32, 65536, dtype=torch.int8), torch.ones(1), output_dtype=15),
    ]
    for call in bad:
        with pytest.raises(formats.FakeNpuError, match=r"OP-DQ|OP-QMM|OMNI-65535"):
            call()
    misread = fake_npu(quant_matmul="nz_misread")  # the variant differs on NZ weights only
    nd = misread.npu_quant_matmul(q, qw, ws, pertoken_scale=s, output_dtype=15)
    assert torch.equal(nd, (acc * ws * s[:, None]).bfloat16())
    assert not torch.equal(misread.npu_quant_matmul(q, nz, ws, pertoken_scale=s, output_dtype=15), nd)


def test_int8_by_tier_against_stock_each_optimization_says_whether_it_acts_under_int8_and_launches(
    runtime, monkeypatch, fake_npu
):
    fake = fake_npu()
    pipe = h.load_int8(runtime, monkeypatch, fake)
    assert len(h.int8_layers(pipe.transformer)) == 8 * len(pipe.transformer.transformer_blocks)
    stock = _images(pipe, runtime, "none")
    assert fake.calls["npu_quant_matmul"] > 0
    exact = _images(pipe, runtime, EXACT + ",+nz_weights")  # NZ int8 weights: int32 sums, bitwise
    assert torch.equal(stock, exact) and torch.equal(stock, generate(pipe, runtime, steps=2, seed=3).images)
    assert registry.get("shared_modulation").stats["hits"] > 0 and registry.get("joint_attention").stats["joint_calls"]
    assert registry.get("nz_weights").report(pipe)["cast"]
    pixel = _images(pipe, runtime, EXACT + ",+nz_weights,+qk_norm")
    assert fake.calls["npu_rms_norm"] > 0 and np.array_equal(to_uint8(stock), to_uint8(pixel))
    # rope's kernel computes in fp32 inside (not stock's three bf16 roundings): as in bf16 (test_rope), close but not
    # pixel-identical on the tiny model
    rope = _images(pipe, runtime, "none,+rope")
    assert fake.calls["npu_rotary_mul"] > 0
    torch.testing.assert_close(rope.float(), stock.float(), atol=3e-2, rtol=3e-2)
    default = _images(pipe, runtime, "default")
    m = compare_images(stock, default)
    assert fake.calls["npu_fusion_attention"] > 0 and m["ssim"] >= 0.99 and m["psnr"] >= 35, m
    # each optimization says whether it acts under int8
    api.select("none,+fused_attention", model=pipe)  # reads the activation dtype of a quantized qkv
    assert pipe.transformer.transformer_blocks[0].attn.to_qkv.weight.dtype == torch.int8
    assert _report.explain(registry.get("fused_attention"), pipe) == []
    api.select("default", model=pipe)
    generate(pipe, runtime, steps=2, seed=3)
    why = {n: _report.explain(registry.get(n), pipe) for n in registry.default_names()}
    acting = {n for n, w in why.items() if not w}
    assert {"shared_modulation", "rope", "fused_attention", "nz_weights", "joint_attention", "qk_norm"} <= acting, why
    assert any("layerwise offload is not enabled" in w for w in why["memo_aware_offload"])  # not int8's doing
    # joint_attention calls the int8 projections as modules and says why, per layer
    ja = registry.get("joint_attention").stats
    assert ja["module_calls"] > 0
    assert any("UnquantizedLinearMethod" in k for k in ja)
    nz = registry.get("nz_weights")
    rep = nz.report(pipe)
    assert set(rep["int8"]) == {f"transformer.{n}" for n in h.int8_layers(pipe.transformer)}
    assert set(rep["int8"].values()) == {"FRACTAL_NZ"}
    assert any(n.startswith("int8: 16 vLLM-Omni NPU int8 linear(s), 16 in FRACTAL_NZ") for n in nz.notes())
    # kernel launches per block, int8 stock and default
    tr = pipe.transformer
    kw = blockops.t2i_inputs(tr, torch.bfloat16)
    stock = blockops.count_block(tr, runtime, kw, "none", npu=True)
    default = blockops.count_block(tr, runtime, kw, "default", npu=True)
    for c in (stock, default):  # one dynamic quant and one int8 GEMM per quantized linear, 8 per block
        assert c.counts["npu::npu_dynamic_quant"] == 8 and c.counts["npu::npu_quant_matmul"] == 8
        assert not c.unresolved
    assert stock.total == 118 and default.total == 48


@pytest.mark.parametrize("quantized_txt_mod", [False, True])
def test_modulation_memo_hits_on_warm_steps_under_int8(runtime, monkeypatch, fake_npu, quantized_txt_mod):
    """vLLM-Omni 0.30 keeps img_mod/txt_mod unquantized under int8 (``safe_quant_config``); a config that quantizes
    txt_mod (as INC does) is keyed on its int8 weight and weight_scale: changing only the scale misses."""
    import importlib

    fake = fake_npu()
    if quantized_txt_mod:
        mod = importlib.import_module("vllm_omni.diffusion.models.qwen_image.qwen_image_transformer")
        monkeypatch.setattr(mod, "safe_quant_config", lambda qc: qc)
    pipe = h.load_int8(runtime, monkeypatch, fake)
    txt = pipe.transformer.transformer_blocks[0].txt_mod[1]
    assert (txt.weight.dtype == torch.int8) is quantized_txt_mod
    assert pipe.transformer.transformer_blocks[0].img_mod[1].weight.dtype == torch.bfloat16
    stock = _images(pipe, runtime, "none")
    sm = registry.get("shared_modulation")
    _images(pipe, runtime, "none,+shared_modulation")
    hits = sm.stats["hits"]
    got = generate(pipe, runtime, steps=2, seed=3).images  # a repeated request: every step's modulation is memoized
    assert torch.equal(stock, got) and sm.stats["hits"] - hits == sm.stats["misses"] > 0, dict(sm.stats)
    if quantized_txt_mod:
        with torch.no_grad():
            for b in pipe.transformer.transformer_blocks:
                b.txt_mod[1].weight_scale.mul_(1.5)  # only the scale changes
        after = _images(pipe, runtime, "none,+shared_modulation")
        assert torch.equal(after, _images(pipe, runtime, "none")) and not torch.equal(after, stock)


def test_ignored_and_over_wide_layers_stay_bf16_as_without_int8(runtime, monkeypatch, fake_npu):
    fake = fake_npu()
    ic = h.npu_int8(monkeypatch, fake)
    monkeypatch.setattr(ic, "NPU_QUANT_MATMUL_MAX_OUT_FEATURES", 200)  # the tiny model's 256-wide FFN up-projection
    pipe = h.load_int8(
        runtime, monkeypatch, fake, ignored_layers=[f"transformer_blocks.{i}.attn.to_add_out" for i in (0, 1)]
    )
    b0 = pipe.transformer.transformer_blocks[0]
    kept = (b0.attn.to_add_out, b0.img_mlp.net[0].proj, b0.txt_mlp.net[0].proj)
    assert all(lin.weight.dtype == torch.bfloat16 for lin in kept)
    assert b0.attn.to_out.weight.dtype == torch.int8
    stock = _images(pipe, runtime, "none")
    assert torch.equal(stock, _images(pipe, runtime, EXACT + ",+nz_weights"))
    rep = registry.get("nz_weights").report(pipe)
    assert "transformer.transformer_blocks.0.attn.to_add_out" in rep["cast"]  # as a bf16 weight
    assert "transformer.transformer_blocks.0.attn.to_add_out" not in rep.get("int8", {})
    ja = registry.get("joint_attention").stats
    assert ja["direct_calls"] > 0  # the unquantized to_add_out as its GEMM, as in bf16


def test_nz_int8_refused_per_shape_with_its_reason(runtime, monkeypatch, fake_npu):
    fake = fake_npu(quant_matmul="nz_misread")
    pipe = h.load_int8(runtime, monkeypatch, fake)
    stock = _images(pipe, runtime, "none")
    got = _images(pipe, runtime, "none,+nz_weights")
    nz = registry.get("nz_weights")
    rep = nz.report(pipe)
    assert torch.equal(stock, got)
    assert all(why.startswith("int8 NZ refused:") and "not bitwise" in why for why in rep["int8"].values())
    assert rep["cast"] and not set(rep["cast"]) & set(rep["int8"])  # the bf16 weights are still cast
    assert all(formats.get_npu_format(m.weight) == formats.ND for n, m in pipe.transformer.named_modules()
               if n in {k.removeprefix("transformer.") for k in rep["int8"]})  # fmt: skip
    assert len([v for v in nz.verdicts() if not v.ok]) == 4  # 64x192, 64x64, 64x256, 256x64: one per shape


def test_nz_int8_fault_rolls_every_weight_back(runtime, monkeypatch, fake_npu):
    """A fault part-way through the cast (after int8 weights were cast) puts every weight back to ND."""
    fake = fake_npu()
    pipe = h.load_int8(runtime, monkeypatch, fake)
    stock = _images(pipe, runtime, "none")
    fake.faults.inject("npu_format_cast", at=20, kind="runtime")
    got = _images(pipe, runtime, "none,+nz_weights")
    nz = registry.get("nz_weights")
    assert fake.faults.fired["npu_format_cast"] == 1 and nz.int8.firsts.values()  # int8 shapes were checked first
    assert nz.report(pipe) == {"cast": [], "skipped": {}}
    assert any("after 19 weight(s)" in w and "every weight was restored to ND" in w for w in _report.explain(nz, pipe))
    fmts = {formats.get_npu_format(m.weight) for m in pipe.transformer.modules() if hasattr(m, "quant_method")}
    assert fmts == {formats.ND} and torch.equal(stock, got)


@pytest.mark.parametrize("nz_ms", [0.8, 1.0])
def test_nz_int8_kept_only_where_the_quant_matmul_is_faster(runtime, monkeypatch, fake_npu, nz_ms):
    """Per int8 weight shape, ``npu_quant_matmul`` on the ND weight then on the NZ one (the activation quantized once
    by ``npu_dynamic_quant``), 2 warm-ups + 5 repeats each: NZ kept where it beats ND by the margin, else the weight
    stays ND with the reason and both figures; the timings are saved and a second start measures none."""
    from vllm_omni_ascend_opt.blocks.kernels import saved, timing
    from vllm_omni_ascend_opt.opts import nz_weights as nzw

    fake = fake_npu(timed=True)
    fake.timing.by_weight_format("npu_quant_matmul", 1.0, nz_ms)
    pipe = h.load_int8(runtime, monkeypatch, fake)
    stock = _images(pipe, runtime, "none")
    qmm, dq = fake.calls["npu_quant_matmul"], fake.calls["npu_dynamic_quant"]
    nz = registry.get("nz_weights")
    nz.stats.clear()
    assert api.select("none,+nz_weights", model=pipe) == ["nz_weights"]
    timed = nz.int8.timed
    assert {k[2:4] for k in timed} == {(64, 192), (64, 64), (64, 256), (256, 64)}
    assert nz.stats["timings"] == 2 * (len(timed) + len(nz.path.timed))  # and the bf16 weights' shapes
    assert all(t["stock_ms"] == 1.0 and t["kernel_ms"] == nz_ms for t in timed.values())
    timed_calls = 2 * (timing.WARMUPS + timing.REPEATS)  # ND then NZ, after the bitwise check's 3 rows x 2 bias x 2
    assert fake.calls["npu_quant_matmul"] - qmm == 4 * (12 + timed_calls)
    assert fake.calls["npu_dynamic_quant"] - dq == 4 * (3 + 1)  # one quantized activation per timed shape
    for key, t in timed.items():
        assert saved.lookup("FRACTAL_NZ int8 weight.timing", key) == (True, "timed", t)
    rep = nz.report(pipe)
    if nz_ms < 1.0:
        assert set(rep["int8"].values()) == {"FRACTAL_NZ"}
    else:
        why = f"{nzw.SKIP_SLOWER} (slower: kernel 1 ms, stock 1 ms (needs 2% less))"
        assert set(rep["int8"].values()) == {why} and rep["skipped"][why] == 16
        assert any(n.startswith(f"int8: 16 vLLM-Omni NPU int8 linear(s), 0 in FRACTAL_NZ; 16 ND: {why}")
                   for n in nz.notes())  # fmt: skip
        assert all(formats.get_npu_format(m.weight) == formats.ND for n, m in pipe.transformer.named_modules()
                   if f"transformer.{n}" in rep["int8"])  # fmt: skip
    assert torch.equal(stock, _images(pipe, runtime, "none,+nz_weights"))
    api.select("none", model=pipe)
    nz.stats.clear()
    assert api.select("none,+nz_weights", model=pipe) == ["nz_weights"]  # again: the saved timings, none measured
    assert nz.stats["timings"] == 0 and nz.report(pipe)["int8"] == rep["int8"]
