"""`shared_modulation`: bitwise-identical to stock, modulation work per forward drops to zero on a warm request; on
vLLM-Omni 0.30's real classes on CPU (tiny Qwen-Image: 2 blocks, hidden 64)."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import sys
from collections import Counter

import pytest
import torch
import torch.nn as nn
from diffusers.models.normalization import AdaLayerNormContinuous

from tests.harness.forward import build, fwd, inputs
from tests.harness.stock import stock_then
from vllm_omni_ascend_opt import api, registry
from vllm_omni_ascend_opt.blocks.body.block_body import NormMod, block_calls
from vllm_omni_ascend_opt.blocks.memo import keys
from vllm_omni_ascend_opt.blocks.memo.cache import ENV_BUDGET_MB, ModulationMemo
from vllm_omni_ascend_opt.blocks.upstream import ada_norm
from vllm_omni_ascend_opt.opts import fast_modulate, fast_residual
from vllm_omni_ascend_opt.opts import shared_modulation as sm
from vllm_omni_ascend_opt.testbed import TINY
from vllm_omni_ascend_opt.testbed.opcount import OpCounter, TensorReadCounter, count_module_calls
from vllm_omni_ascend_opt.testbed.pipeline import generate
from vllm_omni_ascend_opt.testbed.tiny_model import random_transformer_state_dict

OPT = sm.OPT
ON = "none,+shared_modulation"
L = TINY.num_layers
PROJ_PER_FORWARD = 2 * L + 1  # img_mod + txt_mod per block, norm_out.linear


# ----- helpers --------------------------------------------------------------------------------------------------------
def T():
    return importlib.import_module("vllm_omni.diffusion.models.qwen_image.qwen_image_transformer")


def mod_tensors(tr) -> list[torch.Tensor]:
    return [p for lin in keys.modulation_linears(tr) for p in lin.parameters()]


def nbytes(ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


# ----- install / uninstall / attach -----------------------------------------------------------------------------------
def test_install_uninstall_restore_by_identity_and_projections_and_weight_bytes_per_step(tiny_pipe, runtime):
    block_cls, model_cls = T().QwenImageTransformerBlock, T().QwenImageTransformer2DModel
    fwd0, load0 = block_cls.__dict__["forward"], model_cls.__dict__["load_weights"]
    tr = tiny_pipe.transformer
    assert OPT.reasons_inactive() == []

    assert api.select(ON, model=tiny_pipe) == ["shared_modulation"]  # attach to an already-built pipeline
    assert block_cls.__dict__["forward"] is not fwd0 and block_cls.forward.__wrapped__ is fwd0
    assert model_cls.__dict__["load_weights"] is not load0
    assert OPT.patches.is_patched(block_cls, "forward")
    for b in tr.transformer_blocks:
        assert OPT.is_prepared(b.img_mod) and OPT.is_prepared(b.txt_mod) and isinstance(b.img_mod, nn.Sequential)
    assert OPT.is_prepared(tr.norm_out) and isinstance(tr.norm_out, AdaLayerNormContinuous)
    assert OPT.reasons_inactive(tiny_pipe) == []
    row = next(r for r in api.status() if r["name"] == "shared_modulation")
    assert row["active"] and row["equivalence"] == "exact"
    assert set(row["parallel_support"].values()) == {"supported"}
    api.select(ON, model=tiny_pipe)  # idempotent
    generate(tiny_pipe, runtime, steps=1)
    assert len(OPT.memo) > 0

    api.select("none", model=tiny_pipe)
    assert block_cls.__dict__["forward"] is fwd0 and model_cls.__dict__["load_weights"] is load0
    assert all(type(b.img_mod) is nn.Sequential and type(b.txt_mod) is nn.Sequential for b in tr.transformer_blocks)
    assert type(tr.norm_out) is AdaLayerNormContinuous
    assert len(OPT.memo) == 0 and OPT.memo.nbytes == 0
    assert OPT.reasons_inactive(tiny_pipe) == ["not installed"]
    steps, mods = 2, mod_tensors(tr)  # projections and weight bytes per step
    mod_bytes, all_bytes = nbytes(mods), nbytes(tr.parameters())
    fraction = mod_bytes / all_bytes
    assert 0.30 < fraction < 0.37, fraction  # ~1/3 of the DiT weights (12 D^2 of 36 D^2 per block)

    def run():
        with TensorReadCounter(mods) as c:
            generate(tiny_pipe, runtime, steps=steps, seed=1, cfg_scale=3.0)  # true CFG: 2 forwards per step
        return c

    stock = run()
    assert stock.calls == steps * 2 * PROJ_PER_FORWARD
    assert stock.bytes == steps * 2 * mod_bytes

    api.select(ON, model=tiny_pipe)
    cold = run()  # the negative branch reuses the positive branch's projections (same t)
    assert cold.calls == steps * PROJ_PER_FORWARD and cold.bytes == steps * mod_bytes
    OPT.reset_stats()
    warm = run()  # repeated request, same steps and resolution
    assert warm.calls == 0 and warm.bytes == 0
    assert OPT.memo.stats["digests"] == steps * 2  # one temb digest per forward
    assert OPT.memo.stats["projections"] == 0 and OPT.memo.stats["silu"] == 0


# ----- bitwise --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("batch", [1, 2])
def test_transformer_output_bitwise(runtime, dtype, batch):
    tr = build(runtime, dtype)
    cases = [
        inputs(dtype, batch, hw=(2, 2), pad=0),
        inputs(dtype, batch, hw=(3, 4), pad=3, seed=1),  # second resolution, padded text mask
        inputs(dtype, batch, hw=(2, 2), pad=2, t=(0.25, 0.75), seed=2),  # per-row timesteps when batch == 2
    ]
    want = stock_then(ON, tr, lambda: [fwd(tr, runtime, kw) for kw in cases])
    for _ in range(2):  # cold (misses), then warm (hits)
        got = [fwd(tr, runtime, kw) for kw in cases]
        for g, w in zip(got, want, strict=True):
            assert g.dtype == dtype and torch.equal(g, w)
    assert OPT.memo.stats["hits"] > 0 and OPT.fallback_reasons() == {}


@pytest.mark.parametrize("cfg", [1.0, 3.0], ids=["no_cfg", "true_cfg"])
def test_pipeline_images_bitwise(tiny_pipe, runtime, cfg):
    sizes = [(32, 32), (32, 48)]
    api.select("none", model=tiny_pipe)
    want = [generate(tiny_pipe, runtime, height=h, width=w, steps=2, seed=3, cfg_scale=cfg).images for h, w in sizes]
    api.select(ON, model=tiny_pipe)
    for (h, w), ref in [*zip(sizes, want, strict=True), (sizes[0], want[0])]:  # the repeated request runs warm
        assert torch.equal(generate(tiny_pipe, runtime, height=h, width=w, steps=2, seed=3, cfg_scale=cfg).images, ref)
    assert OPT.memo.stats["hits"] > 0
    assert OPT.fallback_reasons() == {}


# ----- counting: SiLU, ops per block; invalidation --------------------------------------------------------------------
def test_warm_counts_teacache_hits_and_inplace_weight_change_misses_and_invalidate_and_reload(runtime):
    from vllm_omni.diffusion.cache.teacache.extractors import extract_qwen_context

    tr = build(runtime)
    kw = inputs(torch.float32)

    def count():
        with OpCounter() as c, count_module_calls(tr.transformer_blocks[0]) as blocks:
            fwd(tr, runtime, kw)
        return c, blocks[0]

    api.select("none", model=tr)
    stock, stock_block = count()
    # stock: 2 per block + norm_out on temb, + 1 inside the timestep embedder (TimestepEmbedding's SiLU)
    assert stock.counts["aten::silu"] == 2 * L + 2
    api.select(ON, model=tr)
    cold, _ = count()
    warm, warm_block = count()
    assert cold.counts["aten::silu"] == 2  # once per distinct temb + the embedder's
    assert warm.counts["aten::silu"] == 0  # none: the repeated timestep's temb is memoized (no embedder SiLU)
    removed = stock_block.counts - warm_block.counts
    assert removed == Counter({"aten::add": 4, "aten::silu": 2, "aten::addmm": 2})  # 1+scale x4, SiLU x2, GEMV x2
    assert not (warm_block.counts - stock_block.counts)  # nothing added
    # TeaCache runs the block loop itself and probes block 0's img_mod: both hit on a warm step
    want = stock_then(ON, tr, lambda: fwd(tr, runtime, kw))

    def via_teacache():
        args = {k: v for k, v in kw.items() if k != "return_dict"}
        with runtime.context(), torch.no_grad(), TensorReadCounter(mod_tensors(tr)) as c:
            ctx = extract_qwen_context(tr, **args, return_dict=False)
            h, _ = ctx.run_transformer_blocks()
            out = ctx.postprocess(h)[0]
        return out, c.calls

    out, cold_calls = via_teacache()
    assert torch.equal(out, want) and cold_calls == PROJ_PER_FORWARD  # the probe's projection is reused by block 0
    out, warm_calls = via_teacache()
    assert torch.equal(out, want) and warm_calls == 0
    # invalidation: an in-place write misses; a write through .data needs weights_changed; load_weights invalidates
    fwd(tr, runtime, kw)
    with torch.no_grad():  # what a LoRA merge / NZ cast in place does: the version counter moves
        tr.transformer_blocks[1].img_mod[1].weight.mul_(1.5)
    with TensorReadCounter(mod_tensors(tr)) as c:
        got_inplace = fwd(tr, runtime, kw)
    assert c.calls == 2  # block 1's img_mod and txt_mod are recomputed, nothing else
    # A write through .data bypasses version counters: explicit invalidate() is the documented remedy.
    tr.transformer_blocks[0].txt_mod[1].weight.data.mul_(2.0)
    registry.REGISTRY.weights_changed(tr)  # the event nz_weights announces after its w.data casts
    got_data = fwd(tr, runtime, kw)
    # load_weights (vLLM's default loader writes through param.data) invalidates by itself.
    tr.load_weights(random_transformer_state_dict(TINY, seed=1).items())
    assert len(OPT.memo) == 0
    got_reload = fwd(tr, runtime, kw)
    api.select("none", model=tr)
    assert torch.equal(got_reload, fwd(tr, runtime, kw))
    tr.load_weights(random_transformer_state_dict(TINY, seed=0).items())
    with torch.no_grad():
        tr.transformer_blocks[1].img_mod[1].weight.mul_(1.5)
    assert torch.equal(got_inplace, fwd(tr, runtime, kw))
    tr.transformer_blocks[0].txt_mod[1].weight.data.mul_(2.0)
    assert torch.equal(got_data, fwd(tr, runtime, kw))


# ----- memory bound ---------------------------------------------------------------------------------------------------
def test_lru_hit_moves_the_entry_and_byte_budget_lru_and_never_exceeded(runtime):
    tr = build(runtime)
    # a hit moves its entry to the recent end, found by digest (a new temb of a known value) or by identity (the last
    # digested temb again, after a view of it made its own entry); eviction takes the least recently used
    seq = tr.transformer_blocks[0].img_mod  # a stock Sequential(SiLU, ReplicatedLinear)
    g = torch.Generator().manual_seed(11)
    a, b, c = (torch.randn(1, TINY.inner_dim, generator=g) for _ in range(3))
    memo = ModulationMemo()

    def call(t: torch.Tensor) -> str:
        hits = memo.stats["hits"]
        with torch.no_grad():
            out, why = memo.direct_projection(seq, t)
            assert why is None and torch.equal(out, nn.Sequential.forward(seq, t))
        assert memo.nbytes <= memo.max_bytes
        return "hit" if memo.stats["hits"] > hits else "miss"

    assert call(a.clone()) == "miss"
    memo.configure(int(2.5 * memo.nbytes))  # room for two temb values
    # digest path: the hit on a moves it past b, so c evicts b (not a); a hits again; b comes back as a miss
    assert [call(t.clone()) for t in (b, a, c, a, b)] == ["miss", "hit", "miss", "hit", "miss"]
    assert memo.stats["evictions"] == 2 and len(memo) == 2

    memo.clear()
    memo.configure(ModulationMemo().max_bytes)
    t = a.clone()
    view = t[:, :]  # a view of the last digested temb: its own entry, keyed by geometry (no digest)
    assert [call(t), call(view)] == ["miss", "miss"] and len(memo) == 2
    memo.configure(int(2.5 * memo.nbytes / 2))
    assert call(t) == "hit"  # the same object as the last digest: moved past the view's entry
    assert call(c.clone()) == "miss"  # evicts the view's entry, the least recently used
    assert [call(t), call(view)] == ["hit", "miss"]  # t digested again (a hit); the view's entry is gone
    api.select(ON, model=tr)

    def step(t):
        with TensorReadCounter(mod_tensors(tr)) as c:
            fwd(tr, runtime, inputs(torch.float32, t=(t,)))
        assert OPT.memo.nbytes <= OPT.memo.max_bytes
        return "hit" if c.calls == 0 else "miss"

    step(0.1)
    per_entry = OPT.memo.nbytes
    # blocks (4 norms x 3 [1,1,64]) + norm_out + SiLU + the memoized temb
    assert per_entry == L * 12 * 64 * 4 + 2 * 64 * 4 + 64 * 4 + 64 * 4
    OPT.memo.configure(int(2.5 * per_entry))  # room for two temb values
    assert [step(t) for t in (0.2, 0.1, 0.3, 0.1, 0.2)] == ["miss", "hit", "miss", "hit", "miss"]  # 0.3 evicts 0.2
    assert OPT.memo.stats["evictions"] >= 2 and len(OPT.memo) == 2
    # below one temb entry: what cannot fit alone is not stored, recomputed next time; outputs stay stock's
    kw = inputs(torch.float32)
    want = stock_then(ON, tr, lambda: fwd(tr, runtime, kw))
    d = TINY.inner_dim
    # fp32 [1, D] temb and SiLU(temb); 2 and 12 [1, 1, D] for norm_out and a block
    temb_bytes, silu_bytes, norm_out_bytes, block_bytes = d * 4, d * 4, 2 * d * 4, 12 * d * 4
    # the memoized temb, SiLU and norm_out fit, no block does
    OPT.memo.configure(temb_bytes + silu_bytes + norm_out_bytes + block_bytes // 2)
    OPT.reset_stats()
    for _ in range(2):
        assert torch.equal(fwd(tr, runtime, kw), want)
        assert OPT.memo.nbytes == temb_bytes + silu_bytes + norm_out_bytes <= OPT.memo.max_bytes
    st = OPT.memo.stats
    assert st["not_stored"] == 2 * L and st["misses"] == 2 * L + 1 and st["hits"] == 1  # norm_out hits once
    assert st["projections"] == 2 * PROJ_PER_FORWARD - 1 and OPT.fallback_reasons() == {}
    OPT.memo.configure(silu_bytes // 2)  # not even SiLU(temb) fits
    OPT.reset_stats()
    assert torch.equal(fwd(tr, runtime, kw), want)
    assert OPT.memo.nbytes == 0 and OPT.memo.stats["not_stored"] > 0 and OPT.fallback_reasons() == {}


def test_budget_env_and_fingerprint_mismatch_turn_it_off(monkeypatch, runtime):
    monkeypatch.setenv(ENV_BUDGET_MB, "lots")
    assert any(ENV_BUDGET_MB in r for r in OPT.reasons_inactive())
    assert api.select(ON) == []  # stays off, with the reason
    monkeypatch.setenv(ENV_BUDGET_MB, "0")
    tr = build(runtime)
    api.select(ON, model=tr)
    assert OPT.memo.max_bytes == 0 and any("budget is 0" in r for r in OPT.reasons_inactive(tr))
    kw = inputs(torch.float32)
    got = fwd(tr, runtime, kw)
    assert any("budget is 0" in r for r in OPT.fallback_reasons()) and len(OPT.memo) == 0
    api.select("none", model=tr)
    assert torch.equal(got, fwd(tr, runtime, kw))
    monkeypatch.setenv(ENV_BUDGET_MB, "1.5")
    api.select(ON)
    assert OPT.memo.max_bytes == int(1.5 * 1024**2)
    api.select("none")
    i = next(i for i, d in enumerate(sm.UPSTREAM) if d.qualname == "QwenImageTransformerBlock.forward")
    unknown = dataclasses.replace(sm.UPSTREAM[i], known={"0" * 16: ("0.30.0",)})
    monkeypatch.setattr(OPT, "upstream", (*sm.UPSTREAM[:i], unknown, *sm.UPSTREAM[i + 1 :]))
    assert any("QwenImageTransformerBlock.forward differs" in r for r in OPT.reasons_inactive())
    assert api.select(ON) == []


# ----- fallbacks: stock code, with a reason ---------------------------------------------------------------------------
def _fallback_case(runtime, tr, reason, kw=None, grad=False):
    kw = kw or inputs(torch.float32)
    want = stock_then(ON, tr, lambda: fwd(tr, runtime, kw, grad))
    OPT.reset_stats()
    with TensorReadCounter(mod_tensors(tr)) as c:
        got = fwd(tr, runtime, kw, grad)
    assert torch.equal(got, want)
    assert any(reason in r for r in OPT.fallback_reasons()), OPT.fallback_reasons()
    return c.calls


def test_tracing_runs_stock_code_and_fallbacks_capture_hooks_autograd(runtime, monkeypatch, fake_npu, caplog):
    tr = build(runtime)
    # while tracing every patched forward and the fast tier's modes run stock code: nothing counted, memoized, logged
    kw = inputs(torch.float32)
    fast = (fast_modulate.OPT, fast_residual.OPT)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    want = stock_then(ON + ",+fast_modulate,+fast_residual", tr, lambda: fwd(tr, runtime, kw))
    for opt in (OPT, *fast):
        opt.reset_stats()
    caplog.set_level("DEBUG", logger="vllm_omni_ascend_opt")
    caplog.clear()
    with TensorReadCounter(mod_tensors(tr)) as reads:
        got = fwd(tr, runtime, kw)
        d = TINY.inner_dim
        mod = NormMod.unpack(*(torch.randn(1, 1, d) for _ in range(3)), ada_norm.NATIVE)
        x = torch.randn(1, 3, d)
        block = tr.transformer_blocks[0]
        fm, fr, _ = block_calls()  # what block_body asks: None while tracing
        assert torch.equal(mod.norm(block.img_norm1, x, fm), block.img_norm1.layernorm(x) * mod.first + mod.shift)
        assert torch.equal(mod.residual(x, x, fr), x + mod.gate * x)
    assert torch.equal(got, want) and reads.calls == PROJ_PER_FORWARD
    assert not OPT.stats and len(OPT.memo) == 0 and OPT.fallback_reasons() == {}
    assert all(opt.ran() == 0 and opt.fallback_reasons() == {} for opt in fast)
    assert not [r for r in caplog.records if r.name.startswith("vllm_omni_ascend_opt")]
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: False)  # eager again: every fallback with its reason
    fake_npu()
    monkeypatch.setattr(torch.npu, "is_current_stream_capturing", lambda: True, raising=False)
    _fallback_case(runtime, tr, "NPU graph capture")
    monkeypatch.setattr(torch.npu, "is_current_stream_capturing", lambda: False)
    h = torch.nn.modules.module.register_module_forward_hook(lambda *a: None)
    try:
        _fallback_case(runtime, tr, "global nn.Module forward hooks")
    finally:
        h.remove()
    h = tr.transformer_blocks[0].img_mod.register_forward_hook(lambda *a: None)
    try:
        _fallback_case(runtime, tr, "forward hooks on a modulation module")
    finally:
        h.remove()
    for p in mod_tensors(tr):
        p.requires_grad_(True)
    assert _fallback_case(runtime, tr, "autograd", grad=True) == PROJ_PER_FORWARD
    assert len(OPT.memo) == 0
    with torch.inference_mode():
        tr = build(runtime)
    api.select(ON, model=tr)
    assert any("inference tensors" in r for r in OPT.reasons_inactive(tr))
    _fallback_case(runtime, tr, "inference tensors")


# ----- AdaLayerNorm dispatch: the NPU path (through the torch_npu fake) and MindIE-SD's fused kernel ------------------
@pytest.mark.parametrize(
    "mindiesd, edit", [(False, False), (True, False), (False, True)], ids=["torch_npu", "mindiesd", "two_segment"]
)
def test_npu_adalayernorm_paths_bitwise(runtime, fake_npu, monkeypatch, mindiesd, edit):
    """The memoized path calls stock's NPU norm: npu_layer_norm_eval (also two-segment), or MindIE-SD's kernel."""
    T()  # imports the model modules when this test runs alone
    fake = fake_npu()
    calls = []

    def spy(input, normalized_shape, weight=None, bias=None, eps=1e-05):  # a marker offset: not the native LayerNorm's
        calls.append(1)
        return torch.nn.functional.layer_norm(input, normalized_shape, weight, bias, eps) + 2.0**-10

    monkeypatch.setattr(fake, "npu_layer_norm_eval", spy, raising=False)
    monkeypatch.setattr(sys.modules[ada_norm.ADALAYERNORM_MODULE], "_HAS_MINDIESD", mindiesd)
    tr = build(runtime, zero_cond_t=edit)
    norms = [n for b in tr.transformer_blocks for n in (b.img_norm1, b.img_norm2, b.txt_norm1, b.txt_norm2)]
    for n in norms:  # what CustomOp binds at construction on an NPU platform
        n._forward_method = n.forward_npu
    assert {ada_norm.norm_kind(n) for n in norms} == {ada_norm.OPAQUE if mindiesd else ada_norm.NPU_EVAL}
    kw = edit_inputs(torch.float32, UNEQUAL, batch=2) if edit else inputs(torch.float32, batch=2, pad=2)
    api.select("none", model=tr)
    want = fwd(tr, runtime, kw)
    per_forward = len(calls)
    assert per_forward == 4 * L  # stock: every AdaLayerNorm of every block goes through the kernel
    api.select(ON, model=tr)
    assert torch.equal(fwd(tr, runtime, kw), want) and torch.equal(fwd(tr, runtime, kw), want)  # cold, warm
    assert len(calls) == 3 * per_forward  # the memoized path calls the same kernel as often as stock
    assert OPT.memo.stats["hits"] > 0 and OPT.fallback_reasons() == {}
    with runtime.context(), torch.no_grad():  # the marker makes the native LayerNorm distinguishable
        x = torch.randn(2, 5, TINY.inner_dim)
        assert not torch.equal(norms[0].layernorm(x), spy(x, [TINY.inner_dim], eps=norms[0].eps))


# ----- the memo key: numerical settings (grad mode, matmul precision, autocast) are part of it ------------------------
def test_numerical_settings_are_part_of_the_key_and_hook_that_captured_stock_forward_is_a_note(runtime):
    """The same temb value (a fresh tensor each call, so the digest runs) under other numerical settings is a miss,
    and a hit again under the first ones; a forward under autocast after a warm fp32 memo equals stock's."""
    from vllm_omni.diffusion.hooks.base import HookRegistry

    tr = build(runtime)
    kw = inputs(torch.float32)

    def fwd_autocast():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return fwd(tr, runtime, kw)

    api.select("none", model=tr)
    want_plain, want_autocast = fwd(tr, runtime, kw), fwd_autocast()
    assert not torch.equal(want_plain, want_autocast)  # autocast changes the result: the setting matters
    api.select(ON, model=tr)
    assert torch.equal(fwd(tr, runtime, kw), want_plain)  # fills the memo in plain fp32
    assert torch.equal(fwd_autocast(), want_autocast)
    assert torch.equal(fwd(tr, runtime, kw), want_plain)
    assert OPT.memo.stats["hits"] > 0 and OPT.fallback_reasons() == {}
    # on the block directly: only the settings differ between the calls (they would change temb in a forward)
    OPT.memo.clear()
    OPT.reset_stats()
    for p in tr.parameters():
        p.requires_grad_(False)  # grad mode on is then memoizable, and keyed apart from grad mode off
    block = tr.transformer_blocks[0]
    temb = torch.randn(1, TINY.inner_dim, generator=torch.Generator().manual_seed(5))
    assert torch.get_float32_matmul_precision() == "highest"

    def misses(ctx) -> int:
        before = OPT.memo.stats["misses"]
        with ctx:
            mods, why = OPT.memo.block(block, temb.clone())
        assert why is None and mods is not None
        return OPT.memo.stats["misses"] - before

    plain = torch.no_grad
    assert misses(plain()) == 1  # cold
    assert misses(plain()) == 0  # warm, same settings
    assert misses(torch.enable_grad()) == 1  # grad mode
    assert misses(torch.enable_grad()) == 0
    torch.set_float32_matmul_precision("medium")
    try:
        assert misses(contextlib.nullcontext()) == 1  # float32 matmul precision
    finally:
        torch.set_float32_matmul_precision("highest")
    assert misses(torch.autocast("cpu", dtype=torch.bfloat16)) == 1  # autocast
    assert misses(plain()) == 0  # the first settings' entry is still there
    assert len(OPT.memo) == 4 and OPT.memo.stats["digests"] == 7
    # a hook registry (MagCache, layerwise offload, SP) that captured the stock block forward: the projections still
    # come from the memo, with a model note; the fast tier (a mode of the block body) gives the note as its reason
    api.select("none", model=tr)
    want = fwd(tr, runtime, kw)
    HookRegistry.get_or_create(tr.transformer_blocks[0])  # captures the stock block forward
    api.select(ON, model=tr)
    assert OPT.reasons_inactive(tr) == []
    (note,) = OPT.model_notes(tr)
    assert "captured the block forward of 1 block(s)" in note
    OPT.reset_stats()
    assert torch.equal(fwd(tr, runtime, kw), want)
    with TensorReadCounter(mod_tensors(tr)) as reads:
        assert torch.equal(fwd(tr, runtime, kw), want)
    assert reads.calls == 0 and OPT.fallback_reasons() == {}  # block 0's img_mod/txt_mod hit the memo too
    api.select(ON + ",+fast_modulate", model=tr)
    assert fast_modulate.OPT.reasons_inactive(tr) == [
        f"{note}: fast_modulate is a mode of shared_modulation's block body"
    ]
    fast_modulate.OPT.reset_stats()
    fwd(tr, runtime, kw)
    assert fast_modulate.OPT.ran() == 4 * (L - 1)  # the four norms of every block but the hooked one


# ----- two-segment modulation (Qwen-Image-Edit-2511 zero_cond_t / modulate_index), issue 14 ---------------------------
def edit_inputs(dtype, shapes, batch=1, t=0.5, seed=0) -> dict:
    """Transformer inputs of an edit request: ``shapes[0]`` is the denoised image, the rest condition images
    (vLLM-Omni's ModulateIndexPrepare: segment 0 for the first shape, segment 1 = timestep 0 for the rest)."""
    kw = inputs(dtype, batch=batch, hw=(1, 1), t=(t,), seed=seed)
    n = sum(f * h * w for f, h, w in shapes)
    kw["hidden_states"] = torch.randn(batch, n, 16, generator=torch.Generator().manual_seed(seed + 1)).to(dtype)
    kw["img_shapes"] = [list(shapes)] * batch
    return kw


EQUAL = [(1, 2, 2), (1, 2, 2)]  # the default edit request: condition image as large as the output -> 2 chunks
UNEQUAL = [(1, 2, 3), (1, 2, 2)]  # 6 + 4 tokens: gcd 2 -> 5 broadcast chunks
COPRIME = [(1, 1, 17), (1, 1, 2), (1, 1, 3)]  # 17 + 5 tokens: gcd 1 -> 22 chunks > 16 -> per-segment slices


#: per edit request: the plan's (start, end, segment) runs, its chunks, and whether it broadcasts
PLANS = {
    "equal": (EQUAL, ((0, 4, 0), (4, 8, 1)), 2, True),
    "unequal": (UNEQUAL, ((0, 6, 0), (6, 10, 1)), 5, True),
    "slices": (COPRIME, ((0, 17, 0), (17, 22, 1)), 22, False),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("case", list(PLANS))
def test_two_segment_blocks_bitwise(runtime, dtype, batch, case):
    """The segment plan is read from vLLM-Omni's own ModulateIndexPrepare output, once per forward."""
    shapes, runs, chunks, broadcast = PLANS[case]
    tr = build(runtime, dtype=dtype, zero_cond_t=True)
    _ts, index = tr.modulate_index_prepare(torch.tensor([0.5] * batch), [shapes] * batch)
    plan, why = OPT.memo.segment_plan(index)
    assert why is None and plan.runs == runs and plan.chunks == chunks and plan.broadcast is broadcast
    kw = edit_inputs(dtype, shapes, batch=batch)
    want = stock_then(ON, tr, lambda: fwd(tr, runtime, kw))
    assert OPT.reasons_inactive(tr) == []
    OPT.reset_stats()
    cold, warm = fwd(tr, runtime, kw), fwd(tr, runtime, kw)
    assert torch.equal(cold, want) and torch.equal(warm, want)
    assert OPT.fallback_reasons() == {} and OPT.memo.stats["plans"] == 2  # one per forward, shared by every block
    assert OPT.memo.stats["misses"] == L + 1 and OPT.memo.stats["hits"] == L + 1  # blocks + norm_out


def test_timestep_zero_segment_is_kept_per_weights_and_warm_ops_per_block(runtime):
    """The timestep-0 segment is found again at every new timestep, and replaced when the weights change."""
    tr = build(runtime, zero_cond_t=True)
    api.select(ON, model=tr)
    OPT.reset_stats()
    outs = {}
    for t in (0.9, 0.5, 0.1):
        kw = edit_inputs(torch.float32, UNEQUAL, t=t)
        outs[t] = fwd(tr, runtime, kw)
    st = OPT.memo.stats
    assert st["zero_t_misses"] == L and st["zero_t_hits"] == 2 * L and st["zero_t_mismatch"] == 0
    d = TINY.inner_dim
    per_block = 6 * d * 4 + 6 * d * 4  # the kept timestep-0 rows [1, 6D] and (1 + scale, shift, gate) x 2 norms
    assert OPT.memo.zero_t_nbytes == L * per_block  # one per block
    with torch.no_grad():
        tr.transformer_blocks[0].img_mod[1].weight.mul_(1.5)  # in place: version counter moves
    kw = edit_inputs(torch.float32, UNEQUAL, t=0.5)
    got = fwd(tr, runtime, kw)
    assert st["zero_t_misses"] == L + 1 and st["zero_t_mismatch"] == 0  # a new key, not a stale hit
    assert OPT.memo.zero_t_nbytes == L * per_block  # block 0's segment for the new weights replaced the old one
    api.select("none", model=tr)
    assert torch.equal(got, fwd(tr, runtime, kw))
    assert not torch.equal(got, outs[0.5])
    # warm forward: no modulation weight read, no torch.where, no SiLU; the block's op count drops
    kw = edit_inputs(torch.float32, EQUAL)
    block = tr.transformer_blocks[-1]
    api.select("none", model=tr)
    with count_module_calls(block) as stock:
        fwd(tr, runtime, kw)
    api.select(ON, model=tr)
    fwd(tr, runtime, kw)
    with TensorReadCounter(mod_tensors(tr)) as reads, count_module_calls(block) as opt:
        fwd(tr, runtime, kw)
    assert reads.calls == 0 and reads.bytes == 0
    s, o = stock[0].counts, opt[0].counts
    assert s["aten::where"] == 6 and s["aten::silu"] == 2  # stock: 3 where per image norm, SiLU per projection
    assert o["aten::where"] == 0 and o["aten::silu"] == 0 and o["aten::addmm"] == s["aten::addmm"] - 2
    assert o["aten::_to_copy"] == 0  # stock converts modulate_index to bool per norm
    assert stock[0].total - opt[0].total >= 14, (stock[0].total, opt[0].total)


def test_two_segment_memo_is_keyed_on_the_segments_inference_mode_and_fallbacks(runtime, monkeypatch):
    """Same temb and length, another split between denoised and condition tokens: a new plan, never a stale hit."""
    tr = build(runtime, zero_cond_t=True)
    same_length = [(1, 2, 3), (1, 1, 2)]  # 6 + 2 tokens, like EQUAL's 4 + 4
    cases = [EQUAL, same_length, EQUAL, UNEQUAL]
    want = stock_then(ON, tr, lambda: [fwd(tr, runtime, edit_inputs(torch.float32, shapes)) for shapes in cases])
    OPT.reset_stats()
    got = [fwd(tr, runtime, edit_inputs(torch.float32, shapes)) for shapes in cases]
    for shapes, w, g in zip(cases, want, got, strict=True):
        assert torch.equal(g, w), shapes
    assert OPT.memo.stats["plans"] == len(cases) and OPT.memo.stats["hits"] > 0  # the EQUAL repeat hits
    # under inference mode views have no ``_base``: ``temb.chunk(2)[0]`` is still known as the block's temb (one
    # digest per forward), and a later no_grad forward reads no modulation weight
    kw = edit_inputs(torch.float32, UNEQUAL)
    want = stock_then(ON, tr, lambda: fwd(tr, runtime, kw))
    OPT.reset_stats()
    with runtime.context(), torch.inference_mode():
        outs = [tr(**kw)[0].clone() for _ in range(2)]
    assert OPT.memo.stats["digests"] == 2 and all(torch.equal(o, want) for o in outs)
    with TensorReadCounter(mod_tensors(tr)) as reads:
        got = fwd(tr, runtime, kw)
    assert reads.calls == 0 and torch.equal(got, want)
    kw = edit_inputs(torch.float32, EQUAL, batch=2)
    prep = tr.modulate_index_prepare

    def rows_differ(module, args, out):
        ts, index = out
        index = index.clone()
        index[1, 0] = 1
        return ts, index

    hook = prep.register_forward_hook(rows_differ)
    assert _fallback_case(runtime, tr, "differs between batch rows", kw=kw) == PROJ_PER_FORWARD  # cold
    hook.remove()
    t = T()
    monkeypatch.setattr(t, "can_use_qwen_select01_triton", lambda x: True)  # stock would run the fused kernels
    _fallback_case(runtime, tr, "Triton select01", kw=kw)
