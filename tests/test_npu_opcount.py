"""The NPU op counter (``testbed/npu_ops.py``): what torch_npu 2.13 would launch, counted on CPU. The registered-op
list is the real wheel's; bf16 ``nn.RMSNorm`` counts as its 8 pieces, layer norm / gelu / SDPA / a fake kernel as one;
per block of the tiny transformer, warm: stock pinned in bf16 through the fake, the default stack below it."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from vllm_omni_ascend_opt.testbed import blockops
from vllm_omni_ascend_opt.testbed.npu_ops import (
    REGISTERED_FILE,
    NpuOpCounter,
    registered_ops,
    resolve,
)
from vllm_omni_ascend_opt.testbed.opcount import OpCounter, count_module_calls

BF16 = torch.bfloat16


def _count(fn) -> NpuOpCounter:
    with NpuOpCounter() as c:
        fn()
    return c


def test_registered_op_file_is_current_with_the_real_wheel():
    from tests.fake_torch_npu import reference
    from tools import gen_npu_registered_ops as gen

    path, why = reference.fetch()
    if path is None:
        pytest.skip(f"the torch-npu {reference.VERSION} wheel is not available: {why}")
    assert REGISTERED_FILE.read_text() == gen.render(path), "run tools/gen_npu_registered_ops.py"
    wheel, sha = REGISTERED_FILE.read_text().splitlines()[:2]  # the header names the wheel it was read from
    assert wheel.endswith(f" {reference.WHEEL_NAME}") and sha.endswith(f" {reference.WHEEL_SHA256}"), (wheel, sha)


def test_registered_op_facts():
    """What the issue relies on, read from the committed list (no network)."""
    ops = registered_ops()
    assert len(ops) > 1000
    assert "native_layer_norm" in ops and "rms_norm" not in ops and "_fused_rms_norm" not in ops
    assert "gelu.out" in ops and "gelu" not in ops  # functional gelu runs through its out= kernel
    assert {"scaled_dot_product_attention", "matmul", "addmm", "_to_copy", "mul.Tensor", "cat"} <= ops
    assert not any(o.startswith("npu_") for o in ops)  # torch.ops.npu.* are not aten ops
    assert "dequantize.self" not in ops  # QuantizedPrivateUse1 only: no kernel for a dense tensor


def test_rmsnorm_in_bf16_counts_its_pieces_layer_norm_gelu_silu_linear_and_sdpa_one_kernel_unregistered_decomposed():
    x, norm = torch.randn(2, 5, 64, dtype=BF16), nn.RMSNorm(64, eps=1e-6).to(BF16)
    c = _count(lambda: norm(x))
    # aten::rms_norm is CompositeImplicitAutograd and torch_npu 2.13 registers no kernel for it: upcast, x^2, mean,
    # + eps, rsqrt, x * rsqrt, * weight, downcast
    assert c.counts == Counter(
        {"_to_copy": 2, "pow.Tensor_Scalar": 1, "mean.dim": 1, "add_.Scalar": 1, "rsqrt": 1, "mul.Tensor": 2}
    )
    assert c.total == 8 and not c.unresolved
    lin = nn.Linear(64, 32).to(BF16)
    assert _count(lambda: F.layer_norm(x, (64,))).counts == Counter({"native_layer_norm": 1})
    assert _count(lambda: F.silu(x)).counts == Counter({"silu": 1})
    assert _count(lambda: lin(x)).counts == Counter({"addmm": 1})
    # structured gelu: torch's CompositeExplicitAutogradNonFunctional kernel calls the registered gelu.out
    assert resolve(torch.ops.aten.gelu.default) == ("kernel", "gelu")
    assert _count(lambda: F.gelu(x, approximate="tanh")).counts == Counter({"gelu": 1})
    q = torch.randn(1, 4, 8, 16, dtype=BF16)
    with OpCounter() as cpu:
        F.scaled_dot_product_attention(q, q, q)
    assert "aten::_scaled_dot_product_flash_attention_for_cpu" in cpu.counts  # what the CPU runs
    c = _count(lambda: F.scaled_dot_product_attention(q, q, q))
    assert c.counts == Counter({"scaled_dot_product_attention": 1})  # torch_npu registers the composite itself
    a, b = torch.randn(2, 3, 8, 16), torch.randn(2, 3, 16, 4)
    assert _count(lambda: a @ b).counts == Counter({"matmul": 1})
    # ``_unsafe_view`` (behind ``reshape`` of a non-contiguous tensor) has a CPU kernel but no NPU one; its
    # decomposition is a view: no launch. The CPU counter counts it; the NPU counter counts only the copy.
    x = torch.randn(4, 6).t()
    with OpCounter() as cpu:
        x.reshape(-1)
    assert cpu.counts == Counter({"aten::clone": 1, "aten::_unsafe_view": 1})
    c = _count(lambda: x.reshape(-1))
    assert c.counts == Counter({"clone": 1}) and c.decomposed == Counter({"_unsafe_view": 1})
    assert resolve(torch.ops.aten._unsafe_view.default)[0] == "decompose"


def test_fake_npu_kernels_count_once_without_their_internals_also_in_nested_counters(fake_npu):
    npu = fake_npu()
    x = torch.randn(1, 8, 2, 16)
    cos, sin = torch.rand(1, 8, 1, 16), torch.rand(1, 8, 1, 16)
    c = _count(lambda: npu.npu_rotary_mul(x, cos, sin, rotary_mode="interleave"))
    assert c.counts == Counter({"npu::npu_rotary_mul": 1}), c.counts
    assert npu.calls["npu_rotary_mul"] == 1
    c = _count(lambda: npu.npu_layer_norm_eval(x, [16]))
    assert c.counts == Counter({"npu::npu_layer_norm_eval": 1})
    assert _count(lambda: npu.get_npu_format(x)).total == 0  # a query: no launch
    q = x.transpose(1, 2)
    with NpuOpCounter() as outer, NpuOpCounter() as inner:
        F.scaled_dot_product_attention(q, q, q)
        npu.npu_rotary_mul(x, cos, sin, rotary_mode="interleave")
        _ = q * 2
    want = Counter({"scaled_dot_product_attention": 1, "npu::npu_rotary_mul": 1, "mul.Tensor": 1})
    assert inner.counts == want and outer.counts == want


def test_stock_block_in_bf16_through_the_fake_is_pinned_and_every_count_placed(runtime, fake_npu):
    """Every configuration's ops have an NPU kernel or a decomposition; counts do not depend on sequence length;
    ``count_module_calls`` takes the NPU counter; ``npu_dispatch`` switches the CustomOps and switches them back; in
    fp32 on CPU the helper counts what test_op_budget counts through the whole pipeline."""
    tr = blockops.build_transformer(runtime, blockops.TINY, torch.float32)
    kw = blockops.t2i_inputs(tr, torch.float32)
    assert blockops.count_block(tr, runtime, kw, "none", npu=False).total == 106
    assert blockops.count_block(tr, runtime, kw, "default", npu=False).total == 46
    fake_npu()
    tr = blockops.build_transformer(runtime, blockops.TINY, BF16)
    kw = blockops.t2i_inputs(tr, BF16)
    stock = blockops.count_block(tr, runtime, kw, "none", npu=True)
    # 110 per block = the CPU counter's 126 less 8 `_unsafe_view` (views: no NPU kernel) and less the native
    # AdaLayerNorm's 8 casts (on Ascend, forward_npu runs npu_layer_norm_eval on the bf16 input). Per block:
    #   modulation, img + txt: silu + addmm                                                   2 x 2 =  4
    #   AdaLayerNorm x 4: npu_layer_norm_eval; modulate: 1 + scale, *, + shift                  4 x 4 = 16
    #   attention 76: to_qkv + add_kv_proj (2 addmm); QK RMSNorms x 4 of 8 (_to_copy, pow, mean, add_, rsqrt,
    #     mul, mul, _to_copy) = 32; stock RoPE x 4 of 8 (stack, neg, 2 clone, 2 mul, add, cat) = 32; 3 cats
    #     joining text and image q/k/v; 4 _to_copy; SDPA 1; to_out + to_add_out (2 addmm)          76
    #   MLPs, img + txt: addmm, gelu, addmm                                                    2 x 3 =  6
    #   gated residuals x 4: gate * y, x + ...                                                 4 x 2 =  8
    assert stock.total == 110, sorted(stock.counts.items())
    assert stock.counts["_to_copy"] == 12 and stock.counts["scaled_dot_product_attention"] == 1
    assert stock.counts["npu::npu_layer_norm_eval"] == 4 and "native_layer_norm" not in stock.counts
    assert not stock.unresolved
    for flags in blockops.configurations().values():
        got = blockops.count_block(tr, runtime, kw, flags, npu=True)
        assert not got.unresolved, (flags, got.unresolved)
    small = blockops.count_block(tr, runtime, blockops.t2i_inputs(tr, BF16, 64, 64), "default", npu=True)
    large = blockops.count_block(tr, runtime, blockops.t2i_inputs(tr, BF16, 256, 128), "default", npu=True)
    assert small.counts == large.counts
    with runtime.context(), torch.no_grad(), count_module_calls(tr.transformer_blocks[0], NpuOpCounter) as calls:
        tr(**kw)
    assert len(calls) == 1 and isinstance(calls[0], NpuOpCounter) and calls[0].total > 0
    # counting for the NPU dispatches the CustomOps to ``forward_npu`` (as on Ascend), then restores the CPU dispatch
    norm = tr.transformer_blocks[0].img_norm1
    before = norm._forward_method
    with blockops.npu_dispatch(tr) as switched:
        assert switched >= 4 * len(tr.transformer_blocks)
        assert norm._forward_method.__func__ is type(norm).forward_npu
    assert norm._forward_method == before
    cpu = blockops.count_block(tr, runtime, kw, "none", npu=False)
    assert cpu.counts["aten::native_layer_norm"] == 4 and not any("npu_layer_norm_eval" in k for k in cpu.counts)
