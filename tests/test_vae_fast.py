"""vae_fast: quality gates vs stock (tiny pipeline, real-width VAE at 256x256), composition with vae_exact, clean
revert, fallbacks; and the quality metrics it is judged by (vllm_omni_ascend_opt.ablation.metrics)."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from diffusers.models.autoencoders.autoencoder_kl_qwenimage import QwenImageCausalConv3d, QwenImageRMS_norm

from tests.harness.stock import stock_then
from tests.test_vae_exact import decode, latent, make_dist_vae, patched_anywhere
from vllm_omni_ascend_opt import api
from vllm_omni_ascend_opt.ablation import metrics
from vllm_omni_ascend_opt.ablation.metrics import compare_images, passes_gates
from vllm_omni_ascend_opt.opts import vae_exact, vae_fast
from vllm_omni_ascend_opt.opts.vae_fast import OPT
from vllm_omni_ascend_opt.testbed.opcount import count_ops
from vllm_omni_ascend_opt.testbed.pipeline import generate


def frames(x: torch.Tensor) -> torch.Tensor:
    """[B, 3, 1, H, W] decoder output -> [B, 3, H, W] image, as the pipeline does."""
    return x[:, :, 0].float()


def assert_nontrivial(img: torch.Tensor) -> None:
    """A gate test on images that are flat or clamped everywhere could not fail."""
    assert img.std() > 0.05, img.std()
    assert (img.abs() >= 1.0).float().mean() < 0.5


# ----- metrics --------------------------------------------------------------------------------------------------------
def test_metrics_identical_images_explicit_data_range_and_value_range():
    img = torch.rand(2, 3, 16, 24) * 2 - 1
    m = compare_images(img, img.clone())
    assert m == {"pixel_identical": True, "max_abs_diff": 0.0, "mean_abs_diff": 0.0, "ssim": 1.0, "psnr": math.inf}
    assert passes_gates(m)
    # A flat mid-grey image and the same image one 8-bit level brighter: MSE = 1 -> PSNR = 20 log10(255).
    ref01 = np.full((1, 3, 16, 16), 128 / 255)
    out01 = np.full((1, 3, 16, 16), 129 / 255)
    m01 = compare_images(ref01, out01, value_range=(0.0, 1.0))
    assert m01["psnr"] == pytest.approx(20 * math.log10(255), abs=1e-6)
    assert not m01["pixel_identical"]
    assert m01["max_abs_diff"] == pytest.approx(1 / 255)
    # The same images given in [-1, 1] (vLLM-Omni's range) give the same 8-bit metrics; diffs are in input units.
    m11 = compare_images(ref01 * 2 - 1, out01 * 2 - 1)
    assert m11["psnr"] == pytest.approx(m01["psnr"]) and m11["ssim"] == pytest.approx(m01["ssim"])
    assert m11["max_abs_diff"] == pytest.approx(2 / 255)
    # The worst image of a batch is reported.
    ref = torch.zeros(2, 3, 16, 16)
    out = ref.clone()
    out[1] += torch.linspace(-0.3, 0.3, 16)
    m = compare_images(ref, out)
    assert m["psnr"] < 30 and m["ssim"] < 0.99 and not passes_gates(m)
    assert compare_images(ref[:1], out[:1])["psnr"] == math.inf
    with pytest.raises(ValueError, match="shape mismatch"):
        compare_images(ref, out[:1])
    with pytest.raises(ValueError, match="value_range"):
        metrics.to_uint8(ref, value_range=(1.0, 1.0))


# ----- gates ----------------------------------------------------------------------------------------------------------
def test_gates_on_tiny_pipeline_and_composition(tiny_pipe, runtime):
    kw = dict(height=48, width=64, steps=2, seed=5)
    ref = stock_then("none,+vae_fast", tiny_pipe, lambda: generate(tiny_pipe, runtime, **kw).images)
    assert OPT.piece_report(tiny_pipe) == {"conv2d_last_tap": "", "rms_norm_input_dtype": ""}
    fast = generate(tiny_pipe, runtime, **kw).images
    api.select("none,+vae_exact,+vae_fast", model=tiny_pipe)
    both = generate(tiny_pipe, runtime, **kw).images
    assert_nontrivial(ref)
    m = compare_images(ref, fast)
    assert passes_gates(m), m
    assert m["max_abs_diff"] > 0  # the fast path really ran (fp32: last bits differ)
    # vae_exact changes no value, so with vae_fast it gives vae_fast's image bit for bit.
    assert torch.equal(fast, both)


@contextlib.contextmanager
def bf16_convs_accumulate_in_fp32() -> Iterator[None]:
    """bf16 convolutions as fp32 sums of the bf16 operands, rounded once to bf16 (as the NPU's cube unit does).

    A CPU without native bf16 (AVX2 only) runs them in a reference loop hundreds of times slower than fp32, which puts
    a real-width decode at 256x256 past any CI budget. Stock and vae_fast both run under it.
    """
    real = {name: getattr(F, name) for name in ("conv2d", "conv3d")}

    def fp32_sum(conv: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        def run(
            x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *args: Any, **kw: Any
        ) -> torch.Tensor:
            if x.dtype != torch.bfloat16:
                return conv(x, weight, bias, *args, **kw)
            return conv(x.float(), weight.float(), None if bias is None else bias.float(), *args, **kw).bfloat16()

        return run

    with pytest.MonkeyPatch.context() as m:
        for name, conv in real.items():
            m.setattr(F, name, fp32_sum(conv))
        yield


@pytest.fixture(scope="module")
def realwidth(runtime):
    """Real-width decoder (base_dim 96, z_dim 16), seeded random weights, and its stock 256x256 decode per dtype."""
    out = {}
    for dt in (torch.float32, torch.bfloat16):
        vae = make_dist_vae(dt, out_gain=2.0, base_dim=96, z_dim=16, latents_mean=[0.0] * 16, latents_std=[1.0] * 16)
        z = latent(32, 32, dt, z=16, seed=7)
        with bf16_convs_accumulate_in_fp32():
            out[dt] = (vae, z, decode(vae, z))
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gates_on_realwidth_vae_256(realwidth, dtype):
    vae, z, ref = realwidth[dtype]
    api.select("none,+vae_fast", model=vae)
    with bf16_convs_accumulate_in_fp32():
        out = decode(vae, z)
    api.select("none", model=vae)
    ref_img, out_img = frames(ref), frames(out)
    assert ref_img.shape == (1, 3, 256, 256)
    assert_nontrivial(ref_img)
    m = compare_images(ref_img, out_img)
    assert passes_gates(m), m
    assert m["max_abs_diff"] > 0


def test_fewer_ops_and_no_zero_padded_conv3d(realwidth):
    vae, _, _ = realwidth[torch.float32]
    z = latent(4, 4, torch.float32, z=16)
    n_spatial = sum(1 for m in vae.decoder.modules() if vae_fast.last_tap_eligible(m) and m.kernel_size[0] == 3)
    n_norms = sum(1 for m in vae.decoder.modules() if vae_fast.norm_eligible(m))
    assert n_spatial == 32 and n_norms == 30
    _, stock = count_ops(lambda: decode(vae, z))
    api.select("none,+vae_fast", model=vae)
    decode(vae, z)  # the first call makes the contiguous last-tap weights (once)
    _, fast = count_ops(lambda: decode(vae, z))
    # Each 3x3x3 conv loses its zero-padded input copy: the padding moves into conv2d.
    assert stock.counts["aten::constant_pad_nd"] - fast.counts["aten::constant_pad_nd"] == n_spatial - 2 == 30
    assert stock.counts["aten::convolution"] == fast.counts["aten::convolution"]  # same convs, 2D now
    # Each norm (fp32: no up/down casts to save there): x / norm, then one in-place product with gamma * scale.
    assert stock.counts["aten::div"] == fast.counts["aten::div"] == n_norms
    assert stock.counts["aten::mul"] - fast.counts["aten::mul"] == 2 * n_norms and fast.counts["aten::mul_"] == n_norms
    assert stock.counts["aten::add"] - fast.counts["aten::add"] == n_norms  # the + 0.0 bias
    assert fast.total < stock.total


# ----- fallbacks, weights, revert -------------------------------------------------------------------------------------
def _last_tap():
    conv = QwenImageCausalConv3d(4, 6, 3, padding=1)
    return conv, vae_fast._make_last_tap_forward(conv).__get__(conv), conv.weight, torch.randn(1, 4, 1, 5, 5)


def _scaled_gamma():
    norm = QwenImageRMS_norm(32, images=False)
    return norm, vae_fast._make_norm_forward(norm).__get__(norm), norm.gamma, torch.randn(2, 32, 1, 6, 5)


@pytest.mark.parametrize("make", [_last_tap, _scaled_gamma], ids=["last_tap", "scaled_gamma"])
def test_cached_weights_follow_updates_and_reloads(make):
    """The last tap's contiguous weights and the norm's gamma * scale follow an in-place update (the version counter
    moves), a reload through ``w.data = ...`` (same Parameter and version counter, new data_ptr) and a re-cast."""
    torch.manual_seed(0)
    module, forward, w, x = make()
    with torch.no_grad():
        before = forward(x)
        w.mul_(2.0)  # in-place reload, LoRA merge
        torch.testing.assert_close(forward(x), module(x), rtol=1e-5, atol=1e-5)
        version = w._version
        w.data = w.data * -3.0  # reloaded weights (a new tensor, same dtype and device)
        assert w._version == version
        after = forward(x)
        torch.testing.assert_close(after, module(x), rtol=1e-5, atol=1e-5)
        module.to(torch.float64)  # moved / re-cast
        assert forward(x.double()).dtype == torch.float64
    assert not torch.allclose(after, before, atol=1e-3)


def test_tracing_runs_the_stock_forwards(monkeypatch):
    """Under torch.compile tracing both pieces run stock code (Conv3d on the padded input, the fp32 RMS norm) bit for
    bit; outside it they take their own paths, except cached or multi-frame conv calls (stock Conv3d)."""
    torch.manual_seed(0)
    conv = QwenImageCausalConv3d(4, 6, 3, padding=1)
    norm = QwenImageRMS_norm(32, images=False).to(torch.bfloat16)
    with torch.no_grad():
        norm.gamma.uniform_(0.5, 1.5)
    conv_forward = vae_fast._make_last_tap_forward(conv).__get__(conv)
    norm_forward = vae_fast._make_norm_forward(norm).__get__(norm)
    x1, x3, cache = torch.randn(1, 4, 1, 5, 5), torch.randn(1, 4, 3, 5, 5), torch.randn(1, 4, 2, 5, 5)
    xn = (torch.randn(2, 32, 1, 6, 5) * 30).bfloat16()
    conv2d = []
    real_conv2d = torch.nn.functional.conv2d
    monkeypatch.setattr(torch.nn.functional, "conv2d", lambda *a, **k: conv2d.append(1) or real_conv2d(*a, **k))
    with torch.no_grad():
        with monkeypatch.context() as m:
            m.setattr(torch.compiler, "is_compiling", lambda: True)
            assert torch.equal(conv_forward(x1), conv(x1)) and conv2d == []
            assert torch.equal(norm_forward(xn), norm(xn))
        got = conv_forward(x1)
        assert conv2d == [1]  # the fast path, outside tracing
        assert torch.allclose(got, conv(x1), atol=1e-5) and got.shape == conv(x1).shape
        assert not torch.equal(norm_forward(xn), norm(xn))  # the input-dtype norm differs from stock in bf16
        assert torch.equal(conv_forward(x3), conv(x3)) and torch.equal(conv_forward(x1, cache), conv(x1, cache))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_rms_norm_input_dtype_close_to_stock(dtype):
    torch.manual_seed(0)
    for norm in (QwenImageRMS_norm(32, images=False), QwenImageRMS_norm(32, images=True, bias=True)):
        with torch.no_grad():
            norm.gamma.uniform_(0.5, 1.5)
            if isinstance(norm.bias, torch.Tensor):
                norm.bias.uniform_(-0.5, 0.5)
        norm.to(dtype)
        x = (torch.randn(2, 32, 1, 6, 5) * 30).to(dtype)  # * 30: fp16 sums of squares overflow without fp32 accum
        x = x[:, :, 0] if norm.gamma.dim() == 3 else x
        forward = vae_fast._make_norm_forward(norm).__get__(norm)
        with torch.no_grad():
            want, got = norm(x), forward(x)
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.isfinite(got).all()
        tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}[dtype]
        torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
        # gamma updated in place (a reload, a LoRA merge): the cached gamma * scale follows its version counter
        with torch.no_grad():
            norm.gamma.mul_(-2.0)
            want2, got2 = norm(x), forward(x)
        assert not torch.allclose(want2.float(), want.float(), rtol=tol, atol=tol)  # the update matters
        torch.testing.assert_close(got2.float(), want2.float(), rtol=tol, atol=tol)
        # gamma kept in fp32 under a low-precision input: stock promotes, so must we
        if dtype != torch.float32:
            norm.gamma.data = norm.gamma.data.float()
            with torch.no_grad():
                assert forward(x).dtype == norm(x).dtype == torch.float32
        # an input dtype outside fp32/bf16/fp16 (never in a decoder) takes the stock forward, bit for bit
        x64 = x.double()
        with torch.no_grad():
            assert torch.equal(forward(x64), norm(x64))


def test_time_conv_and_pointwise_convs_are_not_touched(realwidth):
    vae, _, _ = realwidth[torch.float32]
    api.select("none,+vae_fast", model=vae)
    assert patched_anywhere(vae.encoder) == []  # encode is never touched
    for name, m in vae.named_modules():
        if name.startswith("encoder."):
            continue
        if name.endswith("time_conv") or name == "post_quant_conv" or name.endswith("conv_shortcut"):
            # time_conv: only ever called with a cache; 1x1x1 convs: vae_exact's (exact) piece.
            assert ("forward" in vars(m)) == name.endswith("time_conv"), name
    assert "_decode" not in vars(vae) and "clear_cache" not in vars(vae)


def test_attach_detach_identity_composition_order_and_reasons_for_other_models(tiny_pipe):
    assert patched_anywhere(tiny_pipe) == []
    api.select("none,+vae_fast,+vae_exact", model=tiny_pipe)
    fast_forwards = {n for n, m in tiny_pipe.vae.named_modules() if "forward" in vars(m)}
    vae_fast.OPT.attach(tiny_pipe)  # idempotent
    # detach vae_exact first: vae_fast's patches survive untouched (disjoint attributes)
    api.select("none,+vae_fast", model=tiny_pipe)
    assert not vae_exact.OPT.is_attached(tiny_pipe)
    still = {n for n, m in tiny_pipe.vae.named_modules() if "forward" in vars(m)}
    assert still and still < fast_forwards
    for n, m in tiny_pipe.vae.named_modules():
        if n in still:
            made_by = vars(m)["forward"].__func__.__qualname__.split(".")[0]
            assert made_by in ("_make_last_tap_forward", "_make_norm_forward"), n
    api.select("none", model=tiny_pipe)
    assert patched_anywhere(tiny_pipe) == []
    # other models: a reason each, nothing patched
    api.select("none,+vae_fast")
    assert OPT.reasons_inactive() == []
    OPT.attach(tiny_pipe.transformer)
    assert OPT.reasons_inactive(tiny_pipe.transformer)
    holder = nn.Module()
    holder.vae = nn.Linear(2, 2)
    OPT.attach(holder)
    assert "not diffusers' AutoencoderKLQwenImage" in OPT.reasons_inactive(holder)[0]
    assert patched_anywhere(holder) == []
    rows = {r["name"]: r for r in api.status()}
    assert rows["vae_fast"]["active"] and not rows["vae_fast"]["default"]
    assert rows["vae_fast"]["equivalence"] == "close"
