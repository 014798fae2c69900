"""The device-time trace (``devtime/``): FLOPs and bytes by hand, launches equal to the counter's.

* :mod:`~vllm_omni_ascend_opt.devtime.costs` on a linear, an SDPA, a layer norm and an element-wise op, by hand;
* the hollow trace of the real model launches exactly what the NPU counter counts, per block and outside the blocks,
  at the tiny width and at the real width, for stock, default and all;
* its FLOPs at real width equal the transformer's by hand (12 d^2 per token and GEMM, 4 S^2 d of attention).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vllm_omni_ascend_opt.devtime import trace as T
from vllm_omni_ascend_opt.devtime.costs import ATTENTION, GEMM, OTHER
from vllm_omni_ascend_opt.devtime.trace import OpTrace
from vllm_omni_ascend_opt.testbed import blockops

BF16 = torch.bfloat16


def _traced(fn) -> OpTrace:
    with OpTrace() as t:
        fn()
    return t


def _only(t: OpTrace):
    (op,) = t.tables["outside"].ops.values()
    return op


def test_linear_flops_and_bytes_by_hand():
    x, w, b = torch.randn(3, 5, 64, dtype=BF16), torch.randn(32, 64, dtype=BF16), torch.randn(32, dtype=BF16)
    op = _only(_traced(lambda: F.linear(x, w, b)))
    assert (op.name, op.kind, op.count) == ("addmm", GEMM, 1)
    assert op.flops == 2 * 15 * 64 * 32  # M=15 rows, K=64, N=32
    assert op.bytes == 2 * (15 * 64 + 64 * 32 + 32 + 15 * 32)  # x, W, bias read; y written; 2 bytes each


def test_sdpa_flops_and_bytes_by_hand():
    q, k, v = (torch.randn(2, 4, n, 16, dtype=BF16) for n in (10, 12, 12))
    op = _only(_traced(lambda: F.scaled_dot_product_attention(q, k, v)))
    assert (op.name, op.kind, op.count) == ("scaled_dot_product_attention", ATTENTION, 1)
    assert op.flops == 4 * 2 * 4 * 10 * 12 * 16  # QK^T and PV: 2 x 2*B*H*Sq*Sk*D
    assert op.bytes == 2 * (2 * 4 * 10 * 16 + 2 * (2 * 4 * 12 * 16) + 2 * 4 * 10 * 16)  # q, k, v read; out written


def test_layer_norm_flops_and_bytes_by_hand():
    x = torch.randn(2, 7, 64, dtype=BF16)
    w, b = torch.ones(64, dtype=BF16), torch.zeros(64, dtype=BF16)
    op = _only(_traced(lambda: F.layer_norm(x, (64,), w, b)))
    assert (op.name, op.kind, op.count) == ("native_layer_norm", OTHER, 1)
    # reads x, w, b; writes y and the mean and rstd, one per row (14 rows), in x's dtype as aten returns them
    assert op.bytes == 2 * (2 * 7 * 64) + 2 * 2 * 64 + 2 * (2 * 7 * 64) + 2 * 14 * 2
    assert op.flops == 2 * 7 * 64 + 2 * 14  # one per output element


def test_elementwise_flops_and_bytes_by_hand():
    x, s = torch.randn(4, 6, 64, dtype=BF16), torch.randn(4, 1, 64, dtype=BF16)
    op = _only(_traced(lambda: x * s))
    assert (op.name, op.kind) == ("mul.Tensor", OTHER)
    assert op.bytes == 2 * (4 * 6 * 64 + 4 * 64 + 4 * 6 * 64)  # the broadcast operand read at its own size
    assert op.flops == 4 * 6 * 64


def test_trace_launches_equal_the_counter_at_tiny_and_real_width_and_the_flops_by_hand(runtime, fake_npu):
    fake_npu()
    real = blockops.build_transformer(runtime, blockops.TINY, BF16)
    kw = blockops.t2i_inputs(real, BF16)
    hollow = T.build_transformer(runtime, blockops.TINY, depth=len(real.transformer_blocks))
    hkw = T.transformer_inputs(hollow, 128, 128, text_tokens=blockops.TEXT_TOKENS)
    wide = T.build_transformer(runtime, T.FULL, depth=2)
    wkw = T.transformer_inputs(wide, 256, 128, text_tokens=32)  # 128 image + 32 text tokens
    for flags in ("none", "default", "all"):
        want = blockops.count_block(real, runtime, kw, flags, npu=True)
        got = T.trace_transformer(runtime, hollow, flags, hkw)
        assert got.block.launches == want.total, flags
        assert got.tables["outside"].launches + got.tables["first"].launches - want.total == want.outside, flags
        counts = {}
        for op in got.block.ops.values():
            counts[op.name] = counts.get(op.name, 0) + op.count
        assert counts == dict(want.counts), flags
        # at real width the launches are the tiny width's: they do not depend on the width
        got = T.trace_transformer(runtime, wide, flags, wkw)
        assert got.block.launches == want.total, flags
        assert got.per_call(60).launches == 60 * want.total + want.outside, flags
        d, s = 3072, 160
        gemm = sum(o.flops for o in got.block.ops.values() if o.kind == GEMM)
        attn = sum(o.flops for o in got.block.ops.values() if o.kind == ATTENTION)
        # q, k, v, out projections (4 d^2) and the 4x MLP (8 d^2) per token, x2 per multiply-add; the modulation
        # GEMVs (stock: 2 streams x 6d x d per sample) where they still run
        mod = 2 * 2 * 6 * d * d if flags == "none" else 0
        assert gemm == 2 * 12 * d * d * s + mod, flags
        assert attn == 4 * s * s * d, flags
