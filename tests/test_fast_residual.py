"""`fast_residual` (close tier, off by default): the block's four gated residuals as ``torch.addcmul`` in
shared_modulation's block body. Installed only when selected, in ``all``; the path runs (counted), replaces exactly
4 muls + 4 adds by 4 addcmuls per block (also for the edit models' two-segment image stream); images within
SSIM >= 0.999 / PSNR >= 45 dB of stock in fp32 and bf16 (not bitwise-equal in bf16); the fallback is reachable."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from tests.test_fast_modulate import bf16_pipe, gates, warm_block  # noqa: F401  (bf16_pipe: a fixture)
from tests.test_shared_modulation import COPRIME, EQUAL, UNEQUAL, build, edit_inputs, fwd, inputs
from vllm_omni_ascend_opt import api, flags, registry
from vllm_omni_ascend_opt.blocks.body.block_body import FAST_RESIDUAL, NormMod
from vllm_omni_ascend_opt.blocks.upstream import ada_norm
from vllm_omni_ascend_opt.opts.fast_residual import OPT
from vllm_omni_ascend_opt.testbed import TINY
from vllm_omni_ascend_opt.testbed.opcount import count_module_calls

L = TINY.num_layers
RESIDUALS_PER_BLOCK = 4
SWAP = Counter({"aten::mul": 4, "aten::add": 4})  # removed per block; added: 4 aten::addcmul
DEFAULT_FAST = "default,+fast_residual"


def test_registered_off_by_default_in_all_close_tier():
    assert "fast_residual" in registry.names()
    assert registry.names().index("fast_residual") > registry.names().index("shared_modulation")
    assert "fast_residual" not in flags.parse_spec("default") and "fast_residual" in flags.parse_spec("all")
    assert OPT.equivalence == OPT.tier() == "close" and OPT.default_enabled is False
    assert OPT.close_gates == (0.999, 45.0) and "1 ulp" in OPT.summary and OPT.needs == ("shared_modulation",)


def test_needs_shared_modulation_and_says_so(runtime):
    tr = build(runtime)
    kw = inputs(torch.float32)
    api.select("none", model=tr)
    want = fwd(tr, runtime, kw)
    api.select("none,+fast_residual", model=tr)
    assert "shared_modulation is not installed" in OPT.reasons_inactive(tr)[0]
    OPT.reset_stats()
    assert torch.equal(fwd(tr, runtime, kw), want) and OPT.ran() == 0
    api.select("none", model=tr)
    assert FAST_RESIDUAL.get() is None and OPT.reasons_inactive(tr) == ["not installed"]


def test_fp32_images_within_gates_ops_per_block(tiny_pipe, runtime):
    kw = dict(height=32, width=32, steps=2, seed=3)
    api.select("none", model=tiny_pipe)
    _, ref = warm_block(tiny_pipe, runtime, **kw)
    api.select("default", model=tiny_pipe)
    default, _ = warm_block(tiny_pipe, runtime, **kw)
    api.select(DEFAULT_FAST, model=tiny_pipe)
    OPT.reset_stats()
    fast, got = warm_block(tiny_pipe, runtime, **kw)
    assert OPT.ran() == 2 * kw["steps"] * L * RESIDUALS_PER_BLOCK and OPT.fallback_reasons() == {}
    assert default - fast == SWAP and fast - default == Counter({"aten::addcmul": 4})
    m = gates(ref, got)  # fp32 on CPU: may well be bitwise (the product is exact often enough); not required
    print(f"\nfp32 ops per block: default {default.total()}, +fast_residual {fast.total()}; vs stock {m}")


def test_bf16_images_within_gates_not_bitwise(bf16_pipe, runtime):  # noqa: F811
    kw = dict(height=32, width=32, steps=4, seed=3)
    api.select("none", model=bf16_pipe)
    _, ref = warm_block(bf16_pipe, runtime, **kw)
    api.select("default", model=bf16_pipe)
    default, _ = warm_block(bf16_pipe, runtime, **kw)
    api.select(DEFAULT_FAST, model=bf16_pipe)
    OPT.reset_stats()
    fast, got = warm_block(bf16_pipe, runtime, **kw)
    assert OPT.ran() > 0 and OPT.fallback_reasons() == {}
    assert default - fast == SWAP and fast - default == Counter({"aten::addcmul": 4})
    assert not torch.equal(got, ref)  # the product is not rounded to bf16 before the sum: a last-bit change
    m = gates(ref, got)
    print(f"\nbf16 ops per block: default {default.total()}, +fast_residual {fast.total()}; vs stock {m}")


def test_fast_tier_together_with_the_fake_npu(tiny_pipe, runtime, fake_npu, monkeypatch):
    """default vs default + the whole fast tier through the torch_npu fake (fp32): 12 fewer ops per block."""
    fake_npu()
    for b in tiny_pipe.transformer.transformer_blocks:
        for n in (b.img_norm1, b.img_norm2, b.txt_norm1, b.txt_norm2):
            monkeypatch.setattr(n, "_forward_method", n.forward_npu)
    kw = dict(height=32, width=32, steps=2, seed=3)
    api.select("none", model=tiny_pipe)
    _, ref = warm_block(tiny_pipe, runtime, **kw)
    api.select("default", model=tiny_pipe)
    default, _ = warm_block(tiny_pipe, runtime, **kw)
    api.select("default,+fast_modulate,+fast_residual", model=tiny_pipe)
    fast, got = warm_block(tiny_pipe, runtime, **kw)
    assert default.total() - fast.total() == 8 + 4
    m = gates(ref, got)
    print(f"\nfake NPU fp32 ops per block: default {default.total()}, +fast tier {fast.total()}; vs stock {m}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shapes", [EQUAL, UNEQUAL, COPRIME], ids=["equal", "unequal", "slices"])
def test_two_segment_blocks(runtime, dtype, shapes):
    """The edit models' image stream: one addcmul per broadcast chunk view, or per segment slice."""
    tr = build(runtime, dtype=dtype, zero_cond_t=True)
    kw = edit_inputs(dtype, shapes)
    block = tr.transformer_blocks[-1]
    api.select("none,+shared_modulation", model=tr)
    fwd(tr, runtime, kw)
    with count_module_calls(block) as base:
        want = fwd(tr, runtime, kw)
    api.select("none,+shared_modulation,+fast_residual", model=tr)
    OPT.reset_stats()
    fwd(tr, runtime, kw)
    with count_module_calls(block) as calls:
        got = fwd(tr, runtime, kw)
    assert OPT.ran() == 2 * L * RESIDUALS_PER_BLOCK and OPT.fallback_reasons() == {}
    removed, added = base[0].counts - calls[0].counts, calls[0].counts - base[0].counts
    segments = 2 if shapes is COPRIME else 1  # slice plans: one addcmul per segment run per image residual
    assert added["aten::addcmul"] == 2 + 2 * segments and removed["aten::add"] >= 2
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got, want, **tol)


def test_mixed_dtypes_fall_back(runtime):
    """Stock promotes ``x + gate * y`` across dtypes; addcmul would not: the reason is counted, stock's ops run."""
    d = TINY.inner_dim
    scale, shift, gate = (torch.randn(1, 1, d, dtype=torch.bfloat16) for _ in range(3))
    mod = NormMod.unpack(scale, shift, gate, ada_norm.NATIVE)
    x, y = torch.randn(1, 5, d), torch.randn(1, 5, d, dtype=torch.bfloat16)
    api.select("none,+shared_modulation,+fast_residual")
    OPT.reset_stats()
    out = mod.residual(x, y)
    assert torch.equal(out, x + gate * y) and out.dtype == torch.float32
    assert OPT.ran() == 0 and "mixed dtypes" in next(iter(OPT.fallback_reasons()))
    xb = x.to(torch.bfloat16)
    assert torch.equal(mod.residual(xb, y), torch.addcmul(xb, gate, y)) and OPT.ran() == 1
