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


def _warm_ops(pipe, rt) -> tuple[int, int, int, torch.Tensor]:
    """(ops of the last block, of one whole transformer call, of its RoPE embedder) on a repeated request; images."""
    tr = pipe.transformer
    generate(pipe, rt, steps=2, seed=3)  # fill caches: the counted request is a repeated one
    with count_module_calls(tr.transformer_blocks[-1]) as block, count_module_calls(tr) as calls:
        with count_module_calls(tr.pos_embed) as rope:
            images = generate(pipe, rt, steps=2, seed=3).images
    assert len(block) == len(calls) == len(rope) == 2
    assert block[0].total == block[1].total and calls[0].total == calls[1].total
    return block[-1].total, calls[-1].total, rope[-1].total, images


def test_default_stack_meets_the_cpu_op_budget_per_block_and_whole_call_bitwise(tiny_pipe, runtime):
    """The per-block budget cannot see once-per-forward work: the whole call on a warm request is counted too."""
    blocks = len(tiny_pipe.transformer.transformer_blocks)
    api.select("none", model=tiny_pipe)
    stock_block, stock_call, stock_rope, ref = _warm_ops(tiny_pipe, runtime)
    api.select("default", model=tiny_pipe)
    assert {"shared_modulation", "rope", "joint_attention"} <= set(api.installed())
    block, call, rope, got = _warm_ops(tiny_pipe, runtime)
    assert 100 <= stock_block <= 110 and block <= 47, (stock_block, block)
    assert torch.equal(ref, got)
    outside_stock, outside = stock_call - blocks * stock_block, call - blocks * block
    assert stock_rope >= 1 and rope == 0  # the RoPE embedder's memo: no kernel at all on a repeated shape
    assert outside <= 15 < outside_stock, (outside, outside_stock)
    assert call <= blocks * 47 + 15


def test_default_stack_with_npu_paths_meets_the_npu_op_budget(tiny_pipe, runtime, fake_npu):
    npu = fake_npu()
    api.select("none", model=tiny_pipe)
    *_, ref = _warm_ops(tiny_pipe, runtime)
    api.select("default", model=tiny_pipe)
    optimized, *_, got = _warm_ops(tiny_pipe, runtime)
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
    assert stock.total == 110 and not stock.unresolved and not default.unresolved and not fast.unresolved
    # the kernels that make the budget are the ones counted (each path ran)
    assert default.counts["npu::npu_rms_norm"] == 4 and default.counts["npu::npu_rotary_mul"] == 2
    assert npu.calls["npu_rotary_mul"] > 0  # the fake's kernels really ran
    assert default.total <= 45, default.counts
    assert fast.total <= 30, fast.counts
    assert blockops.ops_per_block(runtime, "none", dtype=torch.float32, npu=False).total == 106  # the CPU budget's
