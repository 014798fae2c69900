"""The device-independent targets: kernel-launching ops per transformer block on a warm request.

Stock 106 on the tiny config; the exact default stack <= 47 on CPU and <= 45 with the torch_npu paths (through the
semantic fake, fp32). The whole transformer call is budgeted too, so once-per-forward work (RoPE tables, timestep
embedding, norm_out) cannot grow unseen: outside the blocks the default stack <= 15.
"""

from __future__ import annotations

import torch

from vllm_omni_ascend_opt import api
from vllm_omni_ascend_opt.testbed.opcount import count_module_calls
from vllm_omni_ascend_opt.testbed.pipeline import generate


def _warm_block_ops(pipe, rt) -> tuple[int, torch.Tensor]:
    generate(pipe, rt, steps=2, seed=3)  # fill caches: the counted request is a repeated one
    with count_module_calls(pipe.transformer.transformer_blocks[-1]) as calls:
        images = generate(pipe, rt, steps=2, seed=3).images
    assert len(calls) == 2 and calls[0].total == calls[1].total
    return calls[-1].total, images


def _warm_call_ops(pipe, rt) -> tuple[int, int]:
    """(ops of one whole transformer call, ops of its RoPE embedder) on a repeated request."""
    generate(pipe, rt, steps=2, seed=3)
    with count_module_calls(pipe.transformer) as calls, count_module_calls(pipe.transformer.pos_embed) as rope:
        generate(pipe, rt, steps=2, seed=3)
    assert len(calls) == 2 and calls[0].total == calls[1].total and len(rope) == 2
    return calls[-1].total, rope[-1].total


def test_whole_transformer_call_budget(tiny_pipe, runtime):
    """The per-block budget cannot see once-per-forward work; this counts the whole call on a warm request."""
    blocks = len(tiny_pipe.transformer.transformer_blocks)
    api.select("none", model=tiny_pipe)
    stock_block, _ = _warm_block_ops(tiny_pipe, runtime)
    stock_call, stock_rope = _warm_call_ops(tiny_pipe, runtime)
    api.select("default", model=tiny_pipe)
    block, _ = _warm_block_ops(tiny_pipe, runtime)
    call, rope = _warm_call_ops(tiny_pipe, runtime)
    outside_stock, outside = stock_call - blocks * stock_block, call - blocks * block
    print(
        f"ops per transformer call: stock {stock_call} ({outside_stock} outside the blocks), default {call} ({outside})"
    )
    assert stock_rope >= 1 and rope == 0  # the RoPE embedder's memo: no kernel at all on a repeated shape
    assert outside <= 15 < outside_stock, (outside, outside_stock)
    assert call <= blocks * 47 + 15


def test_default_stack_meets_the_cpu_op_budget_bitwise(tiny_pipe, runtime):
    api.select("none", model=tiny_pipe)
    stock, ref = _warm_block_ops(tiny_pipe, runtime)
    api.select("default", model=tiny_pipe)
    assert {"shared_modulation", "rope", "joint_attention"} <= set(api.installed())
    optimized, got = _warm_block_ops(tiny_pipe, runtime)
    assert 100 <= stock <= 110
    print(f"ops per block: stock {stock}, default stack {optimized}")
    assert optimized <= 47, optimized
    assert torch.equal(ref, got)


def test_default_stack_with_npu_paths_meets_the_npu_op_budget(tiny_pipe, runtime, fake_npu):
    npu = fake_npu()
    api.select("none", model=tiny_pipe)
    _, ref = _warm_block_ops(tiny_pipe, runtime)
    api.select("default", model=tiny_pipe)
    optimized, got = _warm_block_ops(tiny_pipe, runtime)
    assert npu.calls["npu_rotary_mul"] > 0  # the rope kernel path is the one counted
    assert npu.calls["npu_rms_norm"] > 0  # and the qk_norm one
    assert optimized <= 45, optimized
    assert torch.equal(ref, got)  # fp32: the fake kernels round like stock


def test_npu_launch_budgets_in_bf16_default_and_fast_tier(runtime, fake_npu):
    """Counted as torch_npu 2.13 would launch them (``NpuOpCounter``) in bf16 through the fake, warm, per block:
    stock 110 (AdaLayerNorm through npu_layer_norm_eval), the default stack <= 45, with the fast tier <= 30."""
    from vllm_omni_ascend_opt.testbed import blockops

    npu = fake_npu()
    stock = blockops.ops_per_block(runtime, "none")
    default = blockops.ops_per_block(runtime, "default")
    fast = blockops.ops_per_block(runtime, "default,+fast_modulate,+fast_residual")
    print(f"NPU launches per block, bf16: stock {stock.total}, default {default.total}, +fast tier {fast.total}")
    print(f"  default: {dict(default.counts)}\n  fast: {dict(fast.counts)}")
    assert stock.total == 110 and not stock.unresolved and not default.unresolved and not fast.unresolved
    # the kernels that make the budget are the ones counted (each path ran)
    assert default.counts["npu::npu_rms_norm"] == 4 and default.counts["npu::npu_rotary_mul"] == 2
    assert npu.calls["npu_rotary_mul"] > 0  # the fake's kernels really ran
    assert default.total <= 45, default.counts
    assert fast.total <= 30, fast.counts
    assert blockops.ops_per_block(runtime, "none", dtype=torch.float32, npu=False).total == 106  # the CPU budget's
