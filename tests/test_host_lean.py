"""Host-lean hot path: the test bed's host-sync counter, per-forward decisions and their invalidation, the memo's
weight keys under layerwise offload, the direct calls of known layers, and bench_host's helpers."""

from __future__ import annotations

import gc
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.harness.forward import build, fwd, inputs, stock_outputs
from tests.harness.runner import loaded
from vllm_omni_ascend_opt import api, registry
from vllm_omni_ascend_opt.testbed.opcount import OpCounter, SyncCounter

BENCHMARKS = str(Path(__file__).resolve().parents[1] / "benchmarks")


def _inputs(hw=(4, 4), t=0.7):
    return inputs(torch.float32, hw=hw, txt=32, t=(t,))


# ----- per-forward decisions: made once per forward, remade by the next one, never used outside a forward -------------
def test_per_forward_decisions_and_memo_precheck_are_remade_every_forward_and_per_call_outside_a_forward(runtime):
    """A forward under autograd after one without sees autograd, the next one without acts again; a block called
    directly after a forward decides for itself (the forward's scope is closed)."""
    from torch.nn.modules import module as torch_module

    from vllm_omni_ascend_opt.blocks.upstream import forward_scope

    tr = build(runtime)
    kw = _inputs()
    api.select("default", model=tr)
    assert "joint_attention" in forward_scope.watched(tr) and "shared_modulation" in forward_scope.watched(tr)
    ja = registry.get("joint_attention")
    ja.reset_stats()
    fwd(tr, runtime, kw)
    assert ja.stats["joint_calls"] == 2 and ja.fallback_reasons() == {}
    fwd(tr, runtime, kw, grad=True)
    assert ja.fallback_reasons() == {"autograd is recording": 2}, ja.fallback_reasons()
    captured = {}
    handle = tr.transformer_blocks[0].register_forward_pre_hook(lambda m, a, k: captured.update(k), with_kwargs=True)
    fwd(tr, runtime, kw)
    handle.remove()
    assert ja.stats["joint_calls"] == 4 and ja.fallback_reasons() == {"autograd is recording": 2}
    assert forward_scope.current() is None  # closed after every forward
    ja.reset_stats()
    with runtime.context(), torch.enable_grad():
        tr.transformer_blocks[0](**captured)
    assert ja.fallback_reasons() == {"autograd is recording": 1}
    # a global module hook is also decided per forward
    want = fwd(tr, runtime, kw)
    ja.reset_stats()
    seen = []
    handle = torch_module.register_module_forward_hook(lambda m, a, o: seen.append(type(m).__name__))
    try:
        got = fwd(tr, runtime, kw)
    finally:
        handle.remove()
    assert ja.fallback_reasons() == {"global module hooks are registered": 2}, ja.fallback_reasons()
    assert "FeedForward" in seen and torch.equal(got, want)
    # the memo's precheck: the same temb object later requiring grad is refused (no stale "may memoize")
    api.select("none,+shared_modulation", model=tr)
    sm = registry.get("shared_modulation")
    block = tr.transformer_blocks[0]
    temb = torch.randn(1, tr.inner_dim)
    with torch.no_grad():
        mods, why = sm.memo.block(block, temb)
    assert mods is not None and why is None
    temb.requires_grad_(True)
    with torch.enable_grad():
        mods, why = sm.memo.block(block, temb)
    assert mods is None and why == "autograd is recording"


@pytest.mark.parametrize("spec", ["none,+joint_attention", "none,+rope"])
def test_rotation_tables_are_decided_per_forward(runtime, spec):
    """Same sequence lengths, other RoPE freqs (4x6 vs 6x4 image tokens): each forward rotates with its own tables,
    bitwise stock (joint_attention: new freqs every forward; rope: one memoized freqs object per shape and stream)."""
    tr = build(runtime)
    cases = [_inputs(hw=(4, 6)), _inputs(hw=(6, 4)), _inputs(hw=(4, 6)), _inputs(hw=(6, 4))]
    want = stock_outputs(tr, runtime, cases, spec)
    opt = registry.get(spec.split("+")[1])
    opt.reset_stats()
    got = [fwd(tr, runtime, kw) for kw in cases]
    assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))
    if "joint" in spec:
        assert opt.stats["joint_calls"] == 2 * len(cases) and opt.stats["joint_freqs_builds"] == len(cases)
    else:  # q and k of both streams per block through the portable path; tables for 2 image shapes + 1 text length
        assert opt.stats["portable_calls"] == 4 * 2 * len(cases) and opt.stats["table_builds"] == 3


def test_direct_calls_ran_and_follow_hooks_patches_a_parameter_class_and_a_function_mode(runtime, monkeypatch):
    """MLPs and attention projections run as their kernels, bitwise; a module gets called as one again once a hook,
    an upstream class patch or a weight class's ``__torch_function__`` appears; a function mode sees ``F.layer_norm``."""
    from torch.overrides import TorchFunctionMode

    tr = build(runtime)
    kw = _inputs()
    (want,) = stock_outputs(tr, runtime, [kw], "default")
    sm, ja = registry.get("shared_modulation"), registry.get("joint_attention")
    fwd(tr, runtime, kw)
    sm.reset_stats()
    ja.reset_stats()
    assert torch.equal(fwd(tr, runtime, kw), want)
    assert sm.stats["direct_calls"] == 4 and sm.stats["module_calls"] == 0  # 2 MLPs x 2 blocks
    assert ja.stats["direct_calls"] == 8 and ja.stats["module_calls"] == 0  # 4 projections x 2 blocks
    fired = []
    b0 = tr.transformer_blocks[0]
    handles = [
        b0.img_mlp.register_forward_hook(lambda *a: fired.append("img_mlp")),
        b0.attn.to_out.register_forward_pre_hook(lambda *a: fired.append("to_out")),
    ]
    try:
        assert torch.equal(fwd(tr, runtime, kw), want)
    finally:
        for h in handles:
            h.remove()
    assert fired == ["to_out", "img_mlp"]
    assert sm.stats["module_calls"] == 1 and ja.stats["module_calls"] == 1
    lin = sys.modules["vllm.model_executor.layers.linear"]
    calls = []
    stock_row = lin.RowParallelLinear.forward

    def patched(self, input_):
        calls.append(1)
        return stock_row(self, input_)

    monkeypatch.setattr(lin.RowParallelLinear, "forward", patched)
    assert torch.equal(fwd(tr, runtime, kw), want)
    assert len(calls) == 8  # to_out, to_add_out and the MLPs' second linears of both blocks: modules again
    monkeypatch.undo()
    calls.clear()
    fwd(tr, runtime, kw)
    assert calls == []
    cls = type(tr.transformer_blocks[0].attn.to_out.weight)
    stock_tf, seen = cls.__torch_function__, []

    def tf(c, func, types, args=(), kwargs=None):
        seen.append(func)
        return stock_tf(func, types, args, kwargs or {})

    monkeypatch.setattr(cls, "__torch_function__", classmethod(tf))
    ja.reset_stats()
    assert torch.equal(fwd(tr, runtime, kw), want)
    assert ja.stats["direct_calls"] == 0 and ja.stats["module_calls"] == 8 and seen
    monkeypatch.undo()
    ja.reset_stats()
    assert torch.equal(fwd(tr, runtime, kw), want)
    assert ja.stats["direct_calls"] == 8 and ja.stats["module_calls"] == 0

    class Seen(TorchFunctionMode):
        def __init__(self) -> None:
            super().__init__()
            self.funcs: list = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            self.funcs.append(func)
            return func(*args, **(kwargs or {}))

    with Seen() as mode:
        assert torch.equal(fwd(tr, runtime, kw), want)
    assert torch.nn.functional.layer_norm in mode.funcs and torch.layer_norm not in mode.funcs


def test_time_embedding_keys_the_memo_without_a_digest_of_temb_and_steps_aside_for_hooks(runtime):
    """The blocks find their memo entry through the timestep's value (read once per forward, B values) and temb's
    identity: no digest of temb; a change of the embedding's weights is a new key (the blocks recompute)."""
    tr = build(runtime)
    kws = [_inputs(t=0.7), _inputs(t=0.3), _inputs(t=0.7)]
    want = stock_outputs(tr, runtime, kws, "none,+shared_modulation")
    sm = registry.get("shared_modulation")
    sm.reset_stats()
    got = [fwd(tr, runtime, kw) for kw in kws]
    with SyncCounter() as syncs:
        again = fwd(tr, runtime, kws[0])
    assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True)) and torch.equal(again, want[0])
    assert sm.stats["time_keys"] == 4 and sm.stats["digests"] == 4  # one timestep read per forward, no temb digest
    assert sm.stats["time_hits"] == 2  # the repeats of t=0.7 return the memoized temb: no embedding kernel runs
    # t=0.7 and t=0.3 miss once each (2 blocks + norm_out); the two repeats of t=0.7 hit
    assert sm.stats["misses"] == 2 * 3 and sm.stats["hits"] == 2 * 3
    assert sm.fallback_reasons() == {}
    sites = [s for s in syncs.sites if "vllm_omni_ascend_opt" in s or "blocks/" in s]
    assert len(sites) == 1 and "time_embedding" in sites[0], dict(syncs.sites)
    # an in-place write to the embedding's weights: temb changes, so does the key: the blocks are recomputed
    with torch.no_grad():
        tr.time_text_embed.timestep_embedder.linear_2.bias.add_(0.5)
    misses = sm.stats["misses"]
    got = fwd(tr, runtime, kws[0])
    assert sm.stats["misses"] == misses + 3
    api.select("none", model=tr)
    assert torch.equal(got, fwd(tr, runtime, kws[0]))
    # a repeated timestep returns its first temb without running the embedding, unless that temb was written in place
    # since; a hook on the embedder makes the memo step aside, with its reason
    kw = _inputs(t=0.4)
    (want,) = stock_outputs(tr, runtime, [kw], "none,+shared_modulation")
    sm.reset_stats()
    fwd(tr, runtime, kw)
    with OpCounter() as ops:
        hit = fwd(tr, runtime, kw)
    assert sm.stats["time_hits"] == 1 and torch.equal(hit, want)
    assert not {"aten::sin", "aten::cos", "aten::silu"} & set(ops.counts), dict(ops.counts)  # no embedding op
    (entry,) = [e for e in sm.memo._entries.values() if e.temb is not None]
    with torch.no_grad():
        entry.temb.add_(1.0)
    again = fwd(tr, runtime, kw)
    assert sm.stats["time_hits"] == 1, "a temb written in place was returned"
    assert torch.equal(again, want)
    sm.reset_stats()
    fired = []
    h = tr.time_text_embed.timestep_embedder.register_forward_hook(lambda *a: fired.append(1))
    try:
        fwd(tr, runtime, kw)
    finally:
        h.remove()
    assert fired == [1]
    assert sm.fallback_reasons() == {"hooks or an instance forward in time_text_embed": 1}


# ----- the memo under vLLM-Omni's layerwise offload: keyed on what identifies the weights, not their storage ----------
class ReplicatedLinearWithLoRA(torch.nn.Module):
    """A runtime-LoRA stand-in named like vLLM's wrapper: ``base(x) + (x @ A^T) @ B^T`` while its slice is active."""

    def __init__(self, base: torch.nn.Module, rank: int = 4) -> None:
        super().__init__()
        self.base_layer = base
        self.lora_a_stacked = (torch.zeros(1, 1, rank, base.input_size),)
        self.lora_b_stacked = (torch.zeros(1, 1, base.output_size, rank),)
        self._diffusion_lora_active_slices = (False,)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base_layer(x)
        if self._diffusion_lora_active_slices[0]:
            out = out + (x @ self.lora_a_stacked[0][0, 0].T) @ self.lora_b_stacked[0][0, 0].T
        return out


def test_memo_under_layerwise_offload_hits_warm_and_misses_real_changes(runtime):
    """Layerwise offload gives every block fresh storage each forward: a warm request still hits everywhere; an
    in-place write and a LoRA switch miss, and the images stay stock's."""

    def request(h):
        return h.generate(height=32, width=32, steps=2, cfg_scale=4.0)

    with loaded(runtime, "default", enable_layerwise_offload=True) as h:
        pipe = h.pipeline
        sm = registry.get("shared_modulation")
        # Hold every block's materialized weights alive across the first two requests, so the allocator cannot hand
        # the warm request the same addresses again: each block then really sees fresh storage.
        held: list[list[torch.Tensor]] = []
        hooks = [
            b.register_forward_pre_hook(lambda m, a: held.append([p.detach() for p in m.parameters()]))
            for b in pipe.transformer.transformer_blocks
        ]
        request(h)
        first = {p.data_ptr() for ps in held for p in ps if p.numel()}
        n_first = len(held)
        sm.reset_stats()
        request(h)  # warm
        for hook in hooks:
            hook.remove()
        warm = {p.data_ptr() for ps in held[n_first:] for p in ps if p.numel()}
        held.clear()
        assert first and warm and not first & warm  # the precondition: fresh storage in every block
        assert sm.stats["misses"] == 0 and sm.stats["hits"] > 0 and sm.fallback_reasons() == {}, dict(sm.stats)
        block = pipe.transformer.transformer_blocks[1]
        with torch.no_grad():
            block.txt_mod[1].weight.add_(0)  # an in-place write: the version counter moves (the values do not)
        sm.reset_stats()
        request(h)
        assert sm.stats["misses"] > 0  # block 1 is recomputed
        lora = ReplicatedLinearWithLoRA(block.img_mod[1])
        block.img_mod._modules["1"] = lora
        request(h)
        sm.reset_stats()
        request(h)
        assert sm.stats["misses"] == 0, dict(sm.stats)  # LoRA attached but inactive: warm again
        g = torch.Generator().manual_seed(7)
        with torch.no_grad():  # the switch: adapter weights uploaded in place, the slice switched on
            lora.lora_a_stacked[0].copy_(torch.randn(lora.lora_a_stacked[0].shape, generator=g) * 0.1)
            lora.lora_b_stacked[0].copy_(torch.randn(lora.lora_b_stacked[0].shape, generator=g) * 0.1)
        lora._diffusion_lora_active_slices = (True,)
        got = request(h)
        assert sm.stats["misses"] > 0
        api.select("none", model=pipe)
        assert torch.equal(got, request(h))


# ----- the sync counter; bench_host: callgrind's per-function counts split, host time per segment in the forward ------
def test_sync_counter_instruction_split_and_segment_timer_split_a_forward_per_block(runtime, monkeypatch, request):
    # the test bed's host-sync counter counts each host read once and says where
    x = torch.randn(4)
    with SyncCounter() as s:
        x.sum().item()  # item -> _local_scalar_dense, counted once
        if x.sum() > 0:  # tensor truthiness
            pass
        x.tolist()
        host = x.cpu()  # the copy to the host
        host.reshape(-1).numpy()  # a read of the host copy: not a second sync
        torch.equal(x, x)  # aten::equal returns a host bool
        float(x[0])  # __float__ -> _local_scalar_dense
    assert s.total == 6, dict(s.sites)
    assert all("test_host_lean.py" in site for site in s.sites)
    y = torch.randn(3)
    with SyncCounter() as s2:
        y + 1
        y.numpy()  # not a read of a .cpu() copy: counted
    assert s2.total == 1
    assert torch.Tensor.item is torch._C.TensorBase.item  # restored on exit
    monkeypatch.syspath_prepend(BENCHMARKS)
    import instructions

    text = """\
--------------------------------------------------------------------------------
Ir
--------------------------------------------------------------------------------
1,500,000 (100.0%)  PROGRAM TOTALS

--------------------------------------------------------------------------------
Ir                   file:function
--------------------------------------------------------------------------------
  700,000 (46.67%)  ???:mkl_blas_avx2_sgemm_kernel_nocopy_TN_b1 [/x/libtorch_cpu.so]
  400,000 (26.67%)  /p/Python/ceval.c:_PyEval_EvalFrameDefault [/x/libpython3.11.so.1.0]
  250,000 (16.67%)  ???:void c10::function_ref<...>::callback_fn<at::native::AVX2::VectorizedLoop2d<...>> [/x/l.so]
  150,000 (10.00%)  ???:at::TensorIteratorBase::build(at::TensorIteratorConfig&) [/x/libtorch_cpu.so]
"""
    assert instructions.parse(text) == (1_500_000, 950_000)  # GEMM + vectorized loop; interpreter, set-up: host
    # bench_host --split: the timed ModuleList is the same object for the measurement: the plugin still acts in every
    # block, the output is bitwise the untimed one, one segment per block plus before and after; the class is restored
    import segments

    tr = build(runtime)
    kw = _inputs()
    api.select("default", model=tr)
    ref = fwd(tr, runtime, kw)
    blocks, cls = tr.transformer_blocks, type(tr.transformer_blocks)
    ja = registry.get("joint_attention")
    ja.reset_stats()
    out = []
    gc.disable()  # a collection of the process's heap inside one segment would outweigh the spin below
    request.addfinalizer(gc.enable)
    with segments.timed_blocks(tr) as timed, runtime.context(), torch.no_grad():
        assert timed is blocks and isinstance(timed, segments.TimedBlocks)
        seg = segments.segments_ns(timed, lambda: out.append(tr(**kw)[0]))
        with pytest.raises(RuntimeError, match="did not iterate"):
            segments.segments_ns(timed, lambda: None)
    assert len(seg) == len(blocks) + 2 and min(seg) >= 0 and seg[1] > 0
    assert torch.equal(out[0], ref)
    assert ja.stats["joint_calls"] == 2 and ja.fallback_reasons() == {}
    assert type(tr.transformer_blocks) is cls and "marks" not in blocks.__dict__
    # each block's time lands in its own segment: a block made 40 ms slower shows in that segment only (the others are
    # compared with the run above, within half the spin, not with a fixed bound that a loaded machine could break)
    base, spin_ns = seg, 40_000_000

    def spin(*_: object) -> None:
        t0 = time.thread_time_ns()
        while time.thread_time_ns() - t0 < spin_ns:
            pass

    handle = blocks[0].register_forward_pre_hook(spin)
    try:
        with segments.timed_blocks(tr) as timed, runtime.context(), torch.no_grad():
            seg = segments.segments_ns(timed, lambda: tr(**kw))
    finally:
        handle.remove()
    assert seg[1] >= spin_ns and all(
        s - b < spin_ns // 2 for i, (s, b) in enumerate(zip(seg, base, strict=True)) if i != 1
    ), (seg, base)
    row = segments.summarize([[1000, 5000, 3000, 2000], [3000, 7000, 5000, 4000]])
    assert row == {"before": 2.0, "first_block": 6.0, "later_block": 4.0, "after": 3.0, "blocks": 2, "total": 15.0}
