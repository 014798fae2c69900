"""The fast tier (close tier, off by default), two modes of shared_modulation's block body: `fast_modulate` (each
AdaLayerNorm as one affine layer norm) and `fast_residual` (the gated residuals as ``torch.addcmul``). Each path runs
(counted), removes exactly its ops per block, stays within its gates (fp32: rounding noise; bf16: not bitwise), and
every fallback is reachable with its reason."""

from __future__ import annotations

import sys
from collections import Counter

import pytest
import torch
import torch.nn as nn

from tests.harness.forward import build, fwd, inputs
from tests.harness.stock import stock_then, warm_block
from tests.test_shared_modulation import COPRIME, EQUAL, UNEQUAL, edit_inputs
from vllm_omni_ascend_opt import api, flags, registry
from vllm_omni_ascend_opt.ablation.metrics import compare_images
from vllm_omni_ascend_opt.blocks.body.block_body import NormMod, block_calls
from vllm_omni_ascend_opt.blocks.memo.cache import ENV_BUDGET_MB
from vllm_omni_ascend_opt.blocks.upstream import ada_norm
from vllm_omni_ascend_opt.opts import fast_modulate, fast_residual
from vllm_omni_ascend_opt.opts import shared_modulation as sm
from vllm_omni_ascend_opt.testbed import TINY
from vllm_omni_ascend_opt.testbed.opcount import count_module_calls
from vllm_omni_ascend_opt.testbed.pipeline import load_pipeline

MOD, RES = fast_modulate.OPT, fast_residual.OPT
L = TINY.num_layers
PER_BLOCK = 4  # AdaLayerNorms (fast_modulate) and gated residuals (fast_residual) per block
SSIM_GATE, PSNR_GATE = MOD.close_gates
SM_ON = "none,+shared_modulation"
MUL_ADD = Counter({"aten::mul": 4, "aten::add": 4})  # the modulation's `* (1 + scale)`, `+ shift`; or `x + gate * y`
ADDCMUL = Counter({"aten::addcmul": 4})
#: what a warm block loses and gains against ``default`` (fp32; bf16); in bf16 fast_modulate also drops the native
#: norm path's x.float() and the cast back (5 kernels per norm -> 1)
OPS = {
    "fast_modulate": {
        torch.float32: (MUL_ADD, Counter()),
        torch.bfloat16: (MUL_ADD + Counter({"aten::_to_copy": 8}), Counter()),
    },
    "fast_residual": {torch.float32: (MUL_ADD, ADDCMUL), torch.bfloat16: (MUL_ADD, ADDCMUL)},
}
OPTS = pytest.mark.parametrize("opt", [MOD, RES], ids=["modulate", "residual"])
IMAGE_STEPS = {torch.float32: 2, torch.bfloat16: 4}
#: largest float difference from stock on [-1, 1] images: fp32 rounding noise only; bf16's last-bit changes
MAX_ABS_DIFF = {torch.float32: 1e-5, torch.bfloat16: 0.05}


@pytest.fixture(scope="module")
def bf16_pipe(runtime):
    return load_pipeline(runtime, dtype=torch.bfloat16)


def assert_close_images(ref: torch.Tensor, got: torch.Tensor, dtype: torch.dtype) -> None:
    m = compare_images(ref, got)
    assert m["ssim"] >= SSIM_GATE and m["psnr"] >= PSNR_GATE and m["max_abs_diff"] <= MAX_ABS_DIFF[dtype], m


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def _npu_norms(blocks, setattr_=setattr) -> None:
    """Bind each AdaLayerNorm's NPU dispatch, as CustomOp does on an NPU platform."""
    for b in blocks:
        for n in (b.img_norm1, b.img_norm2, b.txt_norm1, b.txt_norm2):
            setattr_(n, "_forward_method", n.forward_npu)


# ----------------------------------------------------------------------------------------------------------------
@OPTS
def test_registered_off_by_default_close_tier_needs_shared_modulation_and_says_so(opt, runtime, monkeypatch):
    names = registry.names()
    assert opt.name in names and names.index(opt.name) > names.index("shared_modulation")
    assert opt.name not in flags.parse_spec("default") and opt.name in flags.parse_spec("all")
    assert opt.equivalence == opt.tier() == "close" and opt.default_enabled is False
    assert opt.close_gates == (0.999, 45.0) and "1 ulp" in opt.summary and opt.needs == ("shared_modulation",)
    assert opt.reasons_inactive() == []
    tr = build(runtime)
    kw = inputs(torch.float32)
    want = stock_then(f"none,+{opt.name}", tr, lambda: fwd(tr, runtime, kw))
    assert opt.installed and not sm.OPT.installed
    assert "shared_modulation is not installed" in opt.reasons_inactive(tr)[0]
    opt.reset_stats()
    assert torch.equal(fwd(tr, runtime, kw), want) and opt.ran() == 0  # stock block: nothing to change
    api.select(f"{SM_ON},+{opt.name}", model=tr)
    assert opt.reasons_inactive(tr) == [] and opt.slot.get() is opt
    api.select("none", model=tr)
    assert not opt.installed and opt.slot.get() is None
    assert opt.reasons_inactive(tr) == ["not installed"]
    monkeypatch.setenv(ENV_BUDGET_MB, "junk")  # inactive where shared_modulation is
    (why,) = opt.reasons_inactive()
    assert why.startswith("needs shared_modulation, which is inactive here:") and ENV_BUDGET_MB in why


@OPTS
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_images_within_gates_ops_per_block(opt, dtype, request, runtime):
    pipe = request.getfixturevalue("tiny_pipe" if dtype == torch.float32 else "bf16_pipe")
    kw = dict(height=32, width=32, steps=IMAGE_STEPS[dtype], seed=3)
    _, ref = warm_block(pipe, runtime, "none", **kw)
    default, got_default = warm_block(pipe, runtime, "default", **kw)
    opt.reset_stats()
    fast, got = warm_block(pipe, runtime, f"default,+{opt.name}", **kw)
    assert torch.equal(got_default, ref)
    assert opt.ran() == 2 * kw["steps"] * L * PER_BLOCK and opt.fallback_reasons() == {}
    assert (default - fast, fast - default) == OPS[opt.name][dtype]
    if dtype == torch.bfloat16:
        assert not torch.equal(got, ref)  # a last-bit change, visible in bf16
    assert_close_images(ref, got, dtype)


def test_npu_path_one_layer_norm_eval_with_weight_and_bias_and_the_whole_tier(
    tiny_pipe, runtime, fake_npu, monkeypatch
):
    """npu_layer_norm_eval takes the [D] affine; the whole tier trades 16 muls/adds for 4 addcmuls per block."""
    fake = fake_npu()
    seen: list[tuple] = []
    kernel = fake.npu_layer_norm_eval

    def spy(x, normalized_shape, weight=None, bias=None, eps=1e-5):
        seen.append((None if weight is None else tuple(weight.shape), None if bias is None else tuple(bias.shape)))
        return kernel(x, normalized_shape, weight=weight, bias=bias, eps=eps)

    monkeypatch.setattr(fake, "npu_layer_norm_eval", spy)
    _npu_norms(tiny_pipe.transformer.transformer_blocks, monkeypatch.setattr)
    kw = dict(height=32, width=32, steps=2, seed=3)
    _, ref = warm_block(tiny_pipe, runtime, "none", **kw)
    default, _ = warm_block(tiny_pipe, runtime, "default", **kw)
    seen.clear()
    fast, got = warm_block(tiny_pipe, runtime, f"default,+{MOD.name}", **kw)
    d = TINY.inner_dim
    assert seen and set(seen) == {((d,), (d,))}  # every call carries weight = 1 + scale and bias = shift
    assert default - fast == MUL_ADD and not fast - default
    assert_close_images(ref, got, torch.float32)
    tier, got = warm_block(tiny_pipe, runtime, f"default,+{MOD.name},+{RES.name}", **kw)
    assert default - tier == MUL_ADD + MUL_ADD and tier - default == ADDCMUL
    assert_close_images(ref, got, torch.float32)


# ----- fast_modulate's fallbacks --------------------------------------------------------------------------------------
def test_batch_rows_with_equal_and_different_modulation_and_layernorm_own_affine_or_hooks(runtime):
    tr = build(runtime)
    same, differ = inputs(torch.float32, batch=2, pad=2), inputs(torch.float32, batch=2, t=(0.25, 0.75), seed=2)
    api.select("none", model=tr)
    want_same, want_differ = fwd(tr, runtime, same), fwd(tr, runtime, differ)
    api.select(f"{SM_ON},+fast_modulate", model=tr)
    MOD.reset_stats()
    _close(fwd(tr, runtime, same), want_same)
    assert MOD.ran() == L * PER_BLOCK and MOD.fallback_reasons() == {}  # one [D] affine serves both rows
    MOD.reset_stats()
    assert torch.equal(fwd(tr, runtime, differ), want_differ)  # stock's ops, bit for bit
    assert MOD.ran() == 0
    (why,) = MOD.fallback_reasons()
    assert "batch rows have different modulation" in why and MOD.fallback_reasons()[why] == L * PER_BLOCK
    kw = inputs(torch.float32)  # a LayerNorm with its own affine weights or hooks
    blk = tr.transformer_blocks[0]
    blk.img_norm1.layernorm.weight = nn.Parameter(torch.full((TINY.inner_dim,), 1.5))  # stock multiplies by it too
    blk.txt_norm1.layernorm.register_forward_hook(lambda *_: None)  # on this test's own model
    want = stock_then(f"{SM_ON},+fast_modulate", tr, lambda: fwd(tr, runtime, kw))
    MOD.reset_stats()
    _close(fwd(tr, runtime, kw), want)
    assert MOD.fallback_reasons() == {
        "the AdaLayerNorm's LayerNorm has its own affine weights": 1,
        "forward hooks on the AdaLayerNorm's LayerNorm": 1,
    }
    assert MOD.ran() == L * PER_BLOCK - 2


@pytest.mark.parametrize("shapes", [EQUAL, COPRIME], ids=["broadcast", "slices"])
def test_two_segment_image_norms_fall_back_text_norms_do_not(runtime, shapes):
    tr = build(runtime, zero_cond_t=True)
    kw = edit_inputs(torch.float32, shapes)
    want = stock_then(f"{SM_ON},+fast_modulate", tr, lambda: fwd(tr, runtime, kw))
    MOD.reset_stats()
    _close(fwd(tr, runtime, kw), want)
    assert MOD.ran() == 2 * L  # the text stream's two norms per block
    (why,) = MOD.fallback_reasons()
    assert "two-segment image norm" in why and MOD.fallback_reasons()[why] == 2 * L


# ----- fast_residual: the two-segment image stream, the fallback ------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shapes", [EQUAL, UNEQUAL, COPRIME], ids=["equal", "unequal", "slices"])
def test_two_segment_blocks(runtime, dtype, shapes):
    """The edit models' image stream: one addcmul per broadcast chunk view, or per segment slice."""
    tr = build(runtime, dtype=dtype, zero_cond_t=True)
    kw = edit_inputs(dtype, shapes)
    block = tr.transformer_blocks[-1]
    api.select(SM_ON, model=tr)
    fwd(tr, runtime, kw)
    with count_module_calls(block) as base:
        want = fwd(tr, runtime, kw)
    api.select(f"{SM_ON},+fast_residual", model=tr)
    RES.reset_stats()
    fwd(tr, runtime, kw)
    with count_module_calls(block) as calls:
        got = fwd(tr, runtime, kw)
    assert RES.ran() == 2 * L * PER_BLOCK and RES.fallback_reasons() == {}
    removed, added = base[0].counts - calls[0].counts, calls[0].counts - base[0].counts
    segments = 2 if shapes is COPRIME else 1  # slice plans: one addcmul per segment run per image residual
    assert added["aten::addcmul"] == 2 + 2 * segments and removed["aten::add"] >= 2
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got, want, **tol)


def test_dtype_shape_and_mindiesd_reasons_and_mixed_dtypes_fall_back(runtime, fake_npu, monkeypatch):
    """Reasons the stock model cannot produce, reached on a NormMod directly: mixed dtypes (stock promotes
    ``x + gate * y``, addcmul would not), non-[B, 1, D] rows."""
    tr = build(runtime)
    norm = tr.transformer_blocks[0].img_norm1
    scale, shift, gate = (torch.randn(1, 1, TINY.inner_dim) for _ in range(3))
    x = torch.randn(1, 5, TINY.inner_dim, dtype=torch.bfloat16)
    api.select(f"{SM_ON},+fast_modulate,+fast_residual")
    MOD.reset_stats()
    mod = NormMod.unpack(scale, shift, gate, ada_norm.NATIVE)
    assert torch.equal(mod.norm(norm, x, block_calls()[0]), norm.layernorm(x) * mod.first + mod.shift)
    assert "dtypes differ" in next(iter(MOD.fallback_reasons()))
    MOD.reset_stats()
    flat = NormMod.unpack(scale[:, 0], shift[:, 0], gate[:, 0], ada_norm.NATIVE)  # [B, D]: no token axis
    flat.norm(norm, x.float(), block_calls()[0])
    assert "not one [B, 1, D] row" in next(iter(MOD.fallback_reasons())) and MOD.ran() == 0
    scale, shift, gate = (t.to(torch.bfloat16) for t in (scale, shift, gate))
    mod = NormMod.unpack(scale, shift, gate, ada_norm.NATIVE)
    x, y = x.float(), torch.randn(1, 5, TINY.inner_dim, dtype=torch.bfloat16)
    RES.reset_stats()
    out = mod.residual(x, y, block_calls()[1])
    assert torch.equal(out, x + gate * y) and out.dtype == torch.float32
    assert RES.ran() == 0 and "mixed dtypes" in next(iter(RES.fallback_reasons()))
    xb = x.to(torch.bfloat16)
    assert torch.equal(mod.residual(xb, y, block_calls()[1]), torch.addcmul(xb, gate, y)) and RES.ran() == 1
    # MindIE-SD's fused AdaLayerNorm: fast_modulate steps aside
    fake_npu()
    monkeypatch.setattr(sys.modules[ada_norm.ADALAYERNORM_MODULE], "_HAS_MINDIESD", True)
    _npu_norms(tr.transformer_blocks)
    kw = inputs(torch.float32)
    want = stock_then(f"{SM_ON},+fast_modulate", tr, lambda: fwd(tr, runtime, kw))
    MOD.reset_stats()
    assert torch.equal(fwd(tr, runtime, kw), want)
    (why,) = MOD.fallback_reasons()
    assert "MindIE-SD" in why and MOD.ran() == 0
