"""`qk_norm`: the four QK RMSNorms per block through ``torch_npu.npu_rms_norm``, verified per shape class.

The fake's kernel (fp32 inside, one rounding) is bitwise stock on these inputs: call logs and counters show it ran."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
import torch.nn as nn

from tests.harness.forward import tiny_forward
from tests.harness.stock import stock_then, warm_block
from vllm_omni_ascend_opt import api
from vllm_omni_ascend_opt.ablation.metrics import to_uint8
from vllm_omni_ascend_opt.blocks.kernels import guard
from vllm_omni_ascend_opt.opts import joint_attention as ja
from vllm_omni_ascend_opt.opts import qk_norm as qn
from vllm_omni_ascend_opt.testbed.opcount import count_module_calls
from vllm_omni_ascend_opt.testbed.pipeline import generate

OPT = qn.OPT


# ----- with the fake: attach/detach, the kernel path, bitwise/pixel results -------------------------------------------
@pytest.mark.parametrize("spec", ["none,+qk_norm", "none,+rope,+joint_attention,+qk_norm", "default"])
def test_pipeline_images_identical_and_the_kernel_ran(fake_npu, tiny_pipe, bf16_transformer, runtime, spec):
    """The four norms per block of this model only are swapped (detach restores them); the images stay stock's."""
    npu = fake_npu()
    ref = stock_then(spec, tiny_pipe, lambda: generate(tiny_pipe, runtime, steps=2, seed=4, cfg_scale=4.0).images)
    norms = qn._qk_norms(tiny_pipe)
    assert len(norms) == 4 * len(tiny_pipe.transformer.transformer_blocks)
    assert all(OPT.is_prepared(n) and type(n) is not nn.RMSNorm and isinstance(n, nn.RMSNorm) for n in norms)
    assert all(type(n) is nn.RMSNorm for n in qn._qk_norms(bf16_transformer))  # not attached there
    OPT.attach(tiny_pipe)  # idempotent
    OPT.install()
    assert OPT.tier() == "pixel" and OPT.reasons_inactive(tiny_pipe) == []
    got = generate(tiny_pipe, runtime, steps=2, seed=4, cfg_scale=4.0).images
    assert np.array_equal(to_uint8(got), to_uint8(ref))  # pixel tier
    assert torch.equal(got, ref)  # fp32: the fake rounds like stock's composite
    assert npu.calls["npu_rms_norm"] > 0 and OPT.stats["kernel_calls"] == npu.calls["npu_rms_norm"]
    assert OPT.stats["shape_checks"] >= 1 and all(v.ok for v in OPT.verdicts())
    if "joint_attention" in spec or spec == "default":
        assert ja.OPT.stats["kernel_norm_calls"] == ja.OPT.stats["joint_calls"] > 0  # the per-stream kernel order
    api.select("none", model=tiny_pipe)
    assert all(type(n) is nn.RMSNorm for n in norms) and not OPT.installed


def test_bf16_transformer_identical_and_with_fused_attention_the_value_reaches_it_contiguous(
    fake_npu, runtime, bf16_transformer
):
    npu = fake_npu()
    ref = stock_then(
        "none,+joint_attention,+qk_norm", bf16_transformer, lambda: tiny_forward(runtime, bf16_transformer)
    )
    got = tiny_forward(runtime, bf16_transformer)
    assert npu.calls["npu_rms_norm"] == 4 * len(bf16_transformer.transformer_blocks)  # 2 streams x (q, k)
    assert ja.OPT.stats["kernel_norm_calls"] == len(bf16_transformer.transformer_blocks)
    assert torch.equal(got, ref)
    # (a) in the qk_norm docstring: v is joined by a cat, so npu_fusion_attention needs no copy of it
    api.select("none,+joint_attention,+qk_norm,+fused_attention", model=bf16_transformer)
    tiny_forward(runtime, bf16_transformer)  # verification outside the count
    with count_module_calls(bf16_transformer.transformer_blocks[-1]) as calls:
        tiny_forward(runtime, bf16_transformer)
    c = calls[-1].counts
    assert c["fake_torch_npu::fusion_attention"] == 1 and c["fake_torch_npu::rms_norm"] == 4
    assert c["aten::cat"] == 3 and c["aten::clone"] == 0, c


def test_ops_per_block_joint_and_per_stream(fake_npu, tiny_pipe, runtime):
    """40 launches per block with joint_attention (a kernel per stream, a cat per q/k), 42 in stock's order."""
    fake_npu()
    joint, _ = warm_block(tiny_pipe, runtime, "default", steps=1, seed=3)
    separate, _ = warm_block(tiny_pipe, runtime, "default,-joint_attention", steps=1, seed=3)
    assert joint["fake_torch_npu::rms_norm"] == 4 == separate["fake_torch_npu::rms_norm"]
    assert joint.total() == 40 and separate.total() == 42, (joint, separate)
    assert "aten::rsqrt" not in joint and "aten::pow" not in joint


# ----- refusals: per shape class, with the reason logged, output stock's ----------------------------------------------
def test_a_raising_kernel_is_a_fault_retried_then_demoted(fake_npu, tiny_pipe, runtime, caplog, monkeypatch):
    """A RuntimeError is no verdict: stock runs, the class is retried, then demoted after MAX_ERRORS, with a reason."""
    npu = fake_npu(rms_norm="raises")
    ref = stock_then("none,+joint_attention,+qk_norm", tiny_pipe, lambda: generate(tiny_pipe, runtime, steps=2, seed=4))
    with caplog.at_level(logging.WARNING, logger="vllm_omni_ascend_opt"):
        got = generate(tiny_pipe, runtime, steps=2, seed=4)
    assert torch.equal(got.images, ref.images) and OPT.verdicts() == [] and OPT.stats["kernel_calls"] == 0
    faults = OPT.path.guard.faults()
    assert faults and all(f.kind == "runtime error" and not f.demoted for f in faults)
    assert "EZ9999" in caplog.text and any("runtime error" in n for n in OPT.notes())
    assert not OPT.reasons_inactive(tiny_pipe)  # not off: retried
    monkeypatch.setattr(guard, "RETRY_CAP", 1)  # retry at every forward (the schedule: test_guard_backoff_schedule)
    for _ in range(guard.MAX_ERRORS):
        tiny_forward(runtime, tiny_pipe.transformer)
    calls = npu.calls["npu_rms_norm"]
    demoted = [f for f in OPT.path.guard.faults() if f.demoted]  # the classes of _forward's shapes
    assert demoted and all(f.errors == guard.MAX_ERRORS for f in demoted)
    assert any("demoted to stock after 6 errors" in n for n in OPT.notes())
    tiny_forward(runtime, tiny_pipe.transformer)
    assert npu.calls["npu_rms_norm"] == calls  # demoted: not retried
    t = OPT.kernel_classes()
    assert t["kernel"] == 0 and t["why"]["demoted: runtime error"] == len(demoted)


def test_refusal_is_per_shape_class(fake_npu, runtime, tiny_pipe, caplog):
    """2x2 patches (16 rows), 7- vs 9-token text (28 rows -> 32, 36 -> 64): wrong for 9 only, refused there."""
    npu = fake_npu()
    good = npu.npu_rms_norm

    def wrong_for_nine_tokens(self, gamma, epsilon=1e-06):
        y, rstd = good(self, gamma, epsilon=epsilon)
        return (y * 2 if self.dim() == 4 and self.shape[1] == 9 else y), rstd

    npu.npu_rms_norm = wrong_for_nine_tokens
    t = tiny_pipe.transformer
    refs = stock_then(
        "none,+joint_attention,+qk_norm", t, lambda: [tiny_forward(runtime, t, txt=n, hw=(2, 2)) for n in (7, 9, 7)]
    )
    with caplog.at_level(logging.WARNING, logger="vllm_omni_ascend_opt"):
        got = [tiny_forward(runtime, t, txt=n, hw=(2, 2)) for n in (7, 9, 7)]
    assert all(torch.equal(a, b) for a, b in zip(refs, got, strict=True))
    by_key = {v.key: v for v in OPT.verdicts()}
    assert by_key[("cpu", torch.float32, 32, 16)].ok  # 7 text tokens x 4 heads
    assert by_key[("cpu", torch.float32, 16, 16)].ok  # 4 image tokens x 4 heads
    assert not by_key[("cpu", torch.float32, 64, 16)].ok  # 9 x 4 = 36 rows
    assert len(by_key) == 3
    assert "rows<=64" in caplog.text and "refused" in caplog.text
    assert OPT.stats["kernel_calls"] > 0 and OPT.tier() == "pixel"


def test_ineligible_calls_run_stock_and_verify_at_shape_accepts_the_documented_result_only(fake_npu):
    npu = fake_npu()
    OPT.install()
    try:
        norm = nn.RMSNorm(16, eps=1e-6)
        OPT._swapped[norm] = nn.RMSNorm
        with torch.no_grad():
            assert OPT.path.apply(norm, torch.randn(2, 3, 16).bfloat16()) is None  # gamma fp32 != self bf16 [OP-RMS]
            assert OPT.path.apply(norm, torch.randn(16)) is None  # 1-D self [OP-RMS]
            assert OPT.path.apply(norm, torch.randn(2, 3, 16).double()) is None  # dtype [OP-RMS]
        assert OPT.path.apply(norm, torch.randn(2, 3, 16)) is None  # autograd
        with torch.no_grad():
            assert OPT.path.apply(nn.RMSNorm(16), torch.randn(2, 16)) is None  # not attached
            assert OPT.path.apply(norm, torch.randn(2, 3, 16)) is not None
        assert npu.calls["npu_rms_norm"] == 1 and OPT.stats["stock_calls"] == 5
    finally:
        OPT.uninstall()
    g = torch.Generator().manual_seed(0)
    w = torch.randn(16, generator=g).bfloat16()
    x = torch.randn(3, 40, 16, generator=g).bfloat16()
    good = nn.functional.rms_norm(x, (16,), w, 1e-6)
    v = qn.OPT.path.check(x, good, w, 1e-6)
    assert v.ok and v.bitwise and v.errors["over_bound"] <= 1.0
    bumped = good.clone()
    bumped[1, 7, 3] = bumped[1, 7, 3] * 1.0625  # one element off by 2^-4 relative
    v = qn.OPT.path.check(x, bumped, w, 1e-6)
    assert not v.ok and "differs from the fp32 reference" in v.reason and "refused" in v.describe()
    assert not qn.OPT.path.check(x, good[:, :-1], w, 1e-6).ok  # wrong shape
    nan = good.clone()
    nan[0, 0, 0] = float("nan")
    assert not qn.OPT.path.check(x, nan, w, 1e-6).ok
