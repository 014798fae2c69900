"""`fast_modulate` (close tier, off by default): each AdaLayerNorm as one affine layer norm in shared_modulation's
block body. Installed only when selected, in ``all``; the path runs (counted) and removes exactly the modulation's
mul/add (and bf16 casts) per block; images within SSIM >= 0.999 / PSNR >= 45 dB of stock in fp32 and bf16 (and not
bitwise-equal in bf16: a real last-bit change); every fallback reachable with its reason."""

from __future__ import annotations

import sys
from collections import Counter

import pytest
import torch
import torch.nn as nn

from tests.test_shared_modulation import COPRIME, EQUAL, build, edit_inputs, fwd, inputs
from vllm_omni_ascend_opt import api, flags, registry
from vllm_omni_ascend_opt.blocks.body.block_body import FAST_MODULATE, NormMod
from vllm_omni_ascend_opt.blocks.memo.cache import ENV_BUDGET_MB
from vllm_omni_ascend_opt.blocks.upstream import ada_norm
from vllm_omni_ascend_opt.metrics import compare_images
from vllm_omni_ascend_opt.opts import shared_modulation as sm
from vllm_omni_ascend_opt.opts.fast_modulate import OPT
from vllm_omni_ascend_opt.testbed import TINY
from vllm_omni_ascend_opt.testbed.opcount import count_module_calls
from vllm_omni_ascend_opt.testbed.pipeline import generate, load_pipeline

L = TINY.num_layers
NORMS_PER_BLOCK = 4
SSIM_GATE, PSNR_GATE = OPT.close_gates
DEFAULT_FAST = "default,+fast_modulate"


@pytest.fixture(scope="module")
def bf16_pipe(runtime):
    return load_pipeline(runtime, dtype=torch.bfloat16)


def warm_block(pipe, rt, **kw) -> tuple[Counter, torch.Tensor]:
    """Op counts of the last block on a repeated (warm) request, and its images."""
    generate(pipe, rt, **kw)
    with count_module_calls(pipe.transformer.transformer_blocks[-1]) as calls:
        images = generate(pipe, rt, **kw).images
    assert calls[0].counts == calls[-1].counts
    return calls[-1].counts, images


def gates(ref: torch.Tensor, got: torch.Tensor) -> dict:
    m = compare_images(ref, got)
    assert m["ssim"] >= SSIM_GATE and m["psnr"] >= PSNR_GATE, m
    return m


# ----------------------------------------------------------------------------------------------------------------
def test_registered_off_by_default_in_all_close_tier():
    assert "fast_modulate" in registry.names()
    assert registry.names().index("fast_modulate") > registry.names().index("shared_modulation")
    assert "fast_modulate" not in flags.parse_spec("default") and "fast_modulate" in flags.parse_spec("all")
    assert OPT.equivalence == OPT.tier() == "close" and OPT.default_enabled is False
    assert OPT.close_gates == (0.999, 45.0) and "1 ulp" in OPT.summary
    assert OPT.reasons_inactive() == []


def test_inactive_where_shared_modulation_is(monkeypatch):
    monkeypatch.setenv(ENV_BUDGET_MB, "junk")
    (why,) = OPT.reasons_inactive()
    assert why.startswith("needs shared_modulation, which is inactive here:") and ENV_BUDGET_MB in why


def test_needs_shared_modulation_and_says_so(runtime):
    tr = build(runtime)
    kw = inputs(torch.float32)
    api.select("none", model=tr)
    want = fwd(tr, runtime, kw)
    api.select("none,+fast_modulate", model=tr)
    assert OPT.installed and not sm.OPT.installed
    assert "shared_modulation is not installed" in OPT.reasons_inactive(tr)[0]
    OPT.reset_stats()
    assert torch.equal(fwd(tr, runtime, kw), want) and OPT.ran() == 0  # stock block: nothing to change
    api.select("none,+shared_modulation,+fast_modulate", model=tr)
    assert OPT.reasons_inactive(tr) == []
    api.select("none", model=tr)
    assert not OPT.installed and FAST_MODULATE.get() is None
    assert OPT.reasons_inactive(tr) == ["not installed"]


def test_fp32_images_within_gates_ops_per_block(tiny_pipe, runtime):
    kw = dict(height=32, width=32, steps=2, seed=3)
    api.select("none", model=tiny_pipe)
    _, ref = warm_block(tiny_pipe, runtime, **kw)
    api.select("default", model=tiny_pipe)
    default, got_default = warm_block(tiny_pipe, runtime, **kw)
    api.select(DEFAULT_FAST, model=tiny_pipe)
    OPT.reset_stats()
    fast, got = warm_block(tiny_pipe, runtime, **kw)
    assert torch.equal(got_default, ref)
    assert OPT.ran() == 2 * kw["steps"] * L * NORMS_PER_BLOCK and OPT.fallback_reasons() == {}
    # the modulation's `* (1 + scale)` and `+ shift` of each norm are gone; nothing is added
    assert default - fast == Counter({"aten::mul": 4, "aten::add": 4}) and not fast - default
    m = gates(ref, got)
    print(f"\nfp32 ops per block: default {default.total()}, +fast_modulate {fast.total()}; vs stock {m}")


def test_bf16_images_within_gates_not_bitwise_ops_per_block(bf16_pipe, runtime):
    kw = dict(height=32, width=32, steps=4, seed=3)
    api.select("none", model=bf16_pipe)
    _, ref = warm_block(bf16_pipe, runtime, **kw)
    api.select("default", model=bf16_pipe)
    default, _ = warm_block(bf16_pipe, runtime, **kw)
    api.select(DEFAULT_FAST, model=bf16_pipe)
    OPT.reset_stats()
    fast, got = warm_block(bf16_pipe, runtime, **kw)
    assert OPT.ran() > 0 and OPT.fallback_reasons() == {}
    # native path in bf16: x.float() and the cast back go too (5 kernels per norm -> 1)
    assert default - fast == Counter({"aten::_to_copy": 8, "aten::mul": 4, "aten::add": 4}) and not fast - default
    assert not torch.equal(got, ref)  # a last-bit change, visible in bf16
    m = gates(ref, got)
    print(f"\nbf16 ops per block: default {default.total()}, +fast_modulate {fast.total()}; vs stock {m}")


def test_npu_path_one_layer_norm_eval_with_weight_and_bias(tiny_pipe, runtime, fake_npu, monkeypatch):
    """Through the torch_npu fake, on the AdaLayerNorms' NPU dispatch: npu_layer_norm_eval takes the [D] affine."""
    fake = fake_npu()
    seen: list[tuple] = []
    kernel = fake.npu_layer_norm_eval

    def spy(x, normalized_shape, weight=None, bias=None, eps=1e-5):
        seen.append((None if weight is None else tuple(weight.shape), None if bias is None else tuple(bias.shape)))
        return kernel(x, normalized_shape, weight=weight, bias=bias, eps=eps)

    monkeypatch.setattr(fake, "npu_layer_norm_eval", spy)
    for b in tiny_pipe.transformer.transformer_blocks:
        for n in (b.img_norm1, b.img_norm2, b.txt_norm1, b.txt_norm2):
            monkeypatch.setattr(n, "_forward_method", n.forward_npu)  # what CustomOp binds on an NPU platform
    kw = dict(height=32, width=32, steps=2, seed=3)
    api.select("none", model=tiny_pipe)
    _, ref = warm_block(tiny_pipe, runtime, **kw)
    api.select("default", model=tiny_pipe)
    default, _ = warm_block(tiny_pipe, runtime, **kw)
    api.select(DEFAULT_FAST, model=tiny_pipe)
    seen.clear()
    fast, got = warm_block(tiny_pipe, runtime, **kw)
    d = TINY.inner_dim
    assert seen and set(seen) == {((d,), (d,))}  # every call carries weight = 1 + scale and bias = shift
    assert default - fast == Counter({"aten::mul": 4, "aten::add": 4}) and not fast - default
    m = gates(ref, got)
    print(f"\nfake NPU fp32 ops per block: default {default.total()}, +fast_modulate {fast.total()}; vs stock {m}")


# ----------------------------------------------------------------------------------------------------------------
# fallbacks
# ----------------------------------------------------------------------------------------------------------------
def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_batch_rows_with_equal_and_different_modulation(runtime):
    tr = build(runtime)
    same, differ = inputs(torch.float32, batch=2, pad=2), inputs(torch.float32, batch=2, t=(0.25, 0.75), seed=2)
    api.select("none", model=tr)
    want_same, want_differ = fwd(tr, runtime, same), fwd(tr, runtime, differ)
    api.select("none,+shared_modulation,+fast_modulate", model=tr)
    OPT.reset_stats()
    _close(fwd(tr, runtime, same), want_same)
    assert OPT.ran() == L * NORMS_PER_BLOCK and OPT.fallback_reasons() == {}  # one [D] affine serves both rows
    OPT.reset_stats()
    assert torch.equal(fwd(tr, runtime, differ), want_differ)  # stock's ops, bit for bit
    assert OPT.ran() == 0
    (why,) = OPT.fallback_reasons()
    assert "batch rows have different modulation" in why and OPT.fallback_reasons()[why] == L * NORMS_PER_BLOCK


@pytest.mark.parametrize("shapes", [EQUAL, COPRIME], ids=["broadcast", "slices"])
def test_two_segment_image_norms_fall_back_text_norms_do_not(runtime, shapes):
    tr = build(runtime, zero_cond_t=True)
    kw = edit_inputs(torch.float32, shapes)
    api.select("none", model=tr)
    want = fwd(tr, runtime, kw)
    api.select("none,+shared_modulation,+fast_modulate", model=tr)
    OPT.reset_stats()
    _close(fwd(tr, runtime, kw), want)
    assert OPT.ran() == 2 * L  # the text stream's two norms per block
    (why,) = OPT.fallback_reasons()
    assert "two-segment image norm" in why and OPT.fallback_reasons()[why] == 2 * L


def test_layernorm_with_own_affine_or_hooks_falls_back(runtime):
    tr = build(runtime)
    kw = inputs(torch.float32)
    blk = tr.transformer_blocks[0]
    d = TINY.inner_dim
    blk.img_norm1.layernorm.weight = nn.Parameter(torch.full((d,), 1.5))  # stock multiplies by it too
    handle = blk.txt_norm1.layernorm.register_forward_hook(lambda *_: None)
    try:
        api.select("none", model=tr)
        want = fwd(tr, runtime, kw)
        api.select("none,+shared_modulation,+fast_modulate", model=tr)
        OPT.reset_stats()
        _close(fwd(tr, runtime, kw), want)
        reasons = OPT.fallback_reasons()
        assert reasons == {
            "the AdaLayerNorm's LayerNorm has its own affine weights": 1,
            "forward hooks on the AdaLayerNorm's LayerNorm": 1,
        }
        assert OPT.ran() == L * NORMS_PER_BLOCK - 2
    finally:
        handle.remove()


def test_mindiesd_adalayernorm_falls_back(runtime, fake_npu, monkeypatch):
    fake_npu()
    monkeypatch.setattr(sys.modules[ada_norm.ADALAYERNORM_MODULE], "_HAS_MINDIESD", True)
    tr = build(runtime)
    for b in tr.transformer_blocks:
        for n in (b.img_norm1, b.img_norm2, b.txt_norm1, b.txt_norm2):
            n._forward_method = n.forward_npu
    kw = inputs(torch.float32)
    api.select("none", model=tr)
    want = fwd(tr, runtime, kw)
    api.select("none,+shared_modulation,+fast_modulate", model=tr)
    OPT.reset_stats()
    assert torch.equal(fwd(tr, runtime, kw), want)
    (why,) = OPT.fallback_reasons()
    assert "MindIE-SD" in why and OPT.ran() == 0


def test_dtype_and_shape_reasons_on_a_norm_mod(runtime):
    """Reasons the stock model cannot produce, reached on a NormMod directly: mixed dtypes, non-[B, 1, D] rows."""
    tr = build(runtime)
    norm = tr.transformer_blocks[0].img_norm1
    d = TINY.inner_dim
    scale, shift, gate = (torch.randn(1, 1, d) for _ in range(3))
    x = torch.randn(1, 5, d, dtype=torch.bfloat16)
    api.select("none,+shared_modulation,+fast_modulate")
    OPT.reset_stats()
    mod = NormMod.unpack(scale, shift, gate, ada_norm.NATIVE)
    assert torch.equal(mod.norm(norm, x), norm.layernorm(x) * mod.first + mod.shift)
    assert "dtypes differ" in next(iter(OPT.fallback_reasons()))
    OPT.reset_stats()
    flat = NormMod.unpack(scale[:, 0], shift[:, 0], gate[:, 0], ada_norm.NATIVE)  # [B, D]: no token axis
    flat.norm(norm, x.float())
    assert "not one [B, 1, D] row" in next(iter(OPT.fallback_reasons())) and OPT.ran() == 0
