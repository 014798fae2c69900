"""`joint_attention`: one join of the two streams, QK norms and RoPE once on the joint sequence - bitwise stock. Every
equality check also proves that the joint path ran (its counters); every fallback is reached with its reason."""

from __future__ import annotations

import copy
import logging
import sys
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn

from tests.harness.forward import tiny_forward
from tests.harness.stock import stock_then, warm_block
from vllm_omni_ascend_opt import api, registry
from vllm_omni_ascend_opt.blocks.body import compiled_blocks, joint_qkv
from vllm_omni_ascend_opt.blocks.body.joint_qkv import READY_ROPE
from vllm_omni_ascend_opt.blocks.kernels import rope_tables
from vllm_omni_ascend_opt.blocks.upstream import targets as _targets
from vllm_omni_ascend_opt.opts import joint_attention as ja
from vllm_omni_ascend_opt.testbed import TINY
from vllm_omni_ascend_opt.testbed.memory import measure
from vllm_omni_ascend_opt.testbed.pipeline import generate

OPT = ja.OPT


def _attn(transformer):
    return transformer.transformer_blocks[0].attn


def _attn_inputs(transformer, *, txt=7, hw=(4, 4), batch=1, seed=0):
    attn = _attn(transformer)
    dtype = attn.to_qkv.weight.dtype
    g = torch.Generator().manual_seed(seed)
    hs = torch.randn(batch, hw[0] * hw[1], attn.dim, generator=g).to(dtype)
    ehs = torch.randn(batch, txt, attn.dim, generator=g).to(dtype)
    vid, txt_f = transformer.pos_embed([(1, *hw)] * batch, [txt] * batch, device=hs.device)
    return hs, ehs, vid, txt_f


def _clone(attn):
    """A shallow copy of ``attn`` with its own four QK norms (vLLM's parameters do not deepcopy), the rest shared."""
    c = copy.copy(attn)
    c._modules = dict(attn._modules)
    for name in ("norm_q", "norm_k", "norm_added_q", "norm_added_k"):
        c._modules[name] = copy.deepcopy(attn._modules[name])
    return c


class _CaptureAttention(nn.Module):
    """Stands in for the attention layer: records what it receives and returns q."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[torch.Tensor, ...]] = []

    def forward(self, q, k, v, md):
        self.seen.append(
            (q.clone(), k.clone(), v.clone(), md.joint_query.clone(), md.joint_key.clone(), md.joint_value)
        )
        return q


def _stock_attn(attn, *args, **kwargs):
    """The unpatched ``QwenImageCrossAttention.forward`` (what stock runs)."""
    return OPT.patches.original(type(attn), "forward")(attn, *args, **kwargs)


# ----- the joint RMSNorm, bitwise -------------------------------------------------------------------------------------
@pytest.mark.parametrize("d", [16, 128], ids=["tiny", "real_head_dim"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_joint_rms_norm_is_bitwise_the_two_norms_and_cat(dtype, d, monkeypatch):
    """On non-contiguous q/k slices of a QKV projection, through ``torch.rms_norm``'s composite and the pieces alike."""
    g = torch.Generator().manual_seed(0)
    st, si, n = 7, 16, 4
    txt_qkv = (torch.randn(2, st, 3 * n * d, generator=g) * 3).to(dtype)
    img_qkv = (torch.randn(2, si, 3 * n * d, generator=g) * 3).to(dtype)
    nt, ni = nn.RMSNorm(d, eps=1e-6).to(dtype), nn.RMSNorm(d, eps=1e-6).to(dtype)
    with torch.no_grad():
        nt.weight.copy_(torch.randn(d, generator=g))
        ni.weight.copy_(torch.randn(d, generator=g))
    tq = txt_qkv[..., : n * d].unflatten(-1, (n, d))
    iq = img_qkv[..., : n * d].unflatten(-1, (n, d))
    joint = torch.cat([txt_qkv, img_qkv], dim=1)[..., : n * d].unflatten(-1, (n, d))
    assert not joint.is_contiguous() and "cpu" in joint_qkv.COMPOSITE_RMS_DEVICES
    with torch.no_grad():  # the optimization runs without autograd only
        want = torch.cat([nt(tq), ni(iq)], dim=1)
        got = ja.joint_rms_norm(joint, st, nt.weight, ni.weight, 1e-6)
        monkeypatch.setattr(joint_qkv, "COMPOSITE_RMS_DEVICES", frozenset())
        pieces = ja.joint_rms_norm(joint, st, nt.weight, ni.weight, 1e-6)
    assert got.dtype == want.dtype and torch.equal(got, want) and torch.equal(pieces, want)


# ----- install / uninstall / status, bitwise on the pipeline ----------------------------------------------------------
def test_listed_with_its_tier_install_uninstall_and_pipeline_default_is_bitwise_none(runtime, tiny_pipe):
    assert "joint_attention" in registry.default_names()
    names = registry.names()  # after vae_fast: patches/ numbers (0007, 0008) follow the registry
    assert names[names.index("vae_fast") + 1 : names.index("vae_fast") + 3] == ["joint_attention", "qk_norm"]
    assert OPT.tier() == "exact" and OPT.reasons_inactive() == []
    cls = sys.modules[_targets.TRANSFORMER].QwenImageCrossAttention
    original = cls.forward
    api.select("none,+joint_attention", model=tiny_pipe)
    assert OPT.installed and OPT.patches.is_patched(cls, "forward") and cls.forward is not original
    assert OPT.reasons_inactive(tiny_pipe) == []
    rows = {r["name"]: r for r in api.status()}
    assert rows["joint_attention"]["tier"] == "exact" and rows["joint_attention"]["active"]
    assert rows["joint_attention"]["flag"] == {"enable": "+joint_attention", "disable": "-joint_attention"}
    patched = cls.forward
    OPT.install()
    assert cls.forward is patched
    api.select("none", model=tiny_pipe)
    assert not OPT.installed and cls.forward is original
    OPT.uninstall()
    assert cls.forward is original
    # on the pipeline: default and its variants are bitwise none, and the joint path ran
    ref = generate(tiny_pipe, runtime, steps=2, seed=5, cfg_scale=4.0).images
    for spec in ("default", "none,+joint_attention", "default,-rope"):
        api.select(spec, model=tiny_pipe)
        OPT.reset_stats()
        got = generate(tiny_pipe, runtime, steps=2, seed=5, cfg_scale=4.0).images
        layers = len(tiny_pipe.transformer.transformer_blocks)
        assert OPT.stats["joint_calls"] >= 2 * 2 * layers, (spec, OPT.notes())  # 2 steps x (cond, uncond)
        assert OPT.fallback_reasons() == {}, spec
        assert torch.equal(got, ref), spec


# ----- bitwise on the transformer, with and without rope --------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("spec", ["none,+joint_attention", "none,+rope,+joint_attention"])
def test_transformer_bitwise_with_padded_masks_and_text_lengths(runtime, tiny_pipe, bf16_transformer, dtype, spec):
    """Padded text masks (the joint mask built as stock builds it); 7- vs 9-token text: joint freqs per text length."""
    t = tiny_pipe.transformer if dtype == "fp32" else bf16_transformer
    cases = [dict(txt=7), dict(txt=9), dict(txt=7, pad=True), dict(txt=9, hw=(4, 6), pad=True), dict(txt=7)]
    refs = stock_then(spec, t, lambda: [tiny_forward(runtime, t, batch=2, **c) for c in cases])
    OPT.reset_stats()
    got = [tiny_forward(runtime, t, batch=2, **c) for c in cases]
    for c, a, b in zip(cases, refs, got, strict=True):
        assert torch.equal(a, b), c
    layers = len(t.transformer_blocks)
    assert OPT.stats["joint_calls"] == len(cases) * layers
    assert OPT.stats["masked_calls"] >= 2 * layers  # the padded cases went through the mask path
    # rope's embedder memo repeats the freqs per shape: (4x4, 7), (4x4, 9), (4x6, 9); without it one per forward
    builds = 3 if "rope" in spec else len(cases)
    assert OPT.stats["joint_freqs_builds"] == builds
    assert OPT.stats["joint_freqs_hits"] == len(cases) - builds
    assert OPT.fallback_reasons() == {}


def test_the_ops_per_block_fall_by_twenty_eight_bitwise(runtime, tiny_pipe):
    """Norms 24 -> 10 (one pass over q and k of both streams), RoPE 16 -> 4 (q and k in one rotation), cats 3 -> 1."""
    without, a = warm_block(tiny_pipe, runtime, "default,-joint_attention", steps=1, seed=3)
    with_, b = warm_block(tiny_pipe, runtime, "default", steps=1, seed=3)
    assert torch.equal(a, b)
    assert without.total() - with_.total() == 28, (without, with_)
    assert with_["aten::cat"] == 1 and without["aten::cat"] == 3
    assert with_["aten::rsqrt"] == 1 and with_["aten::stack"] == 1 and with_["aten::clone"] == 1


# ----- the attention module directly: SP branch, views through the attention, fallbacks -------------------------------
class _LoraLike(nn.Module):
    """A runtime-LoRA-style wrapper around a QKV projection: ``base(x) + x @ A @ B``, returning ``(out, bias)``."""

    def __init__(self, base: nn.Module, d_in: int, d_out: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(7)
        self.base = base
        self.a = nn.Parameter(torch.randn(d_in, 2, generator=g) * 0.1)
        self.b = nn.Parameter(torch.randn(2, d_out, generator=g) * 0.1)

    def forward(self, x):
        out, bias = self.base(x)
        return out + x @ self.a @ self.b, bias


def test_sp_branch_value_view_and_wrapped_projections_are_bitwise(runtime, tiny_pipe, monkeypatch):
    """SP > 1: the text q/k/v as ``joint_*`` metadata at the attention layer are stock's values, bitwise."""
    mod = sys.modules[_targets.TRANSFORMER]
    api.select("none,+joint_attention", model=tiny_pipe)
    attn = _clone(_attn(tiny_pipe.transformer))
    attn.parallel_config = SimpleNamespace(sequence_parallel_size=2)
    monkeypatch.setattr(mod, "get_forward_context", lambda: SimpleNamespace(split_text_embed_in_sp=False))
    attn.attn = _CaptureAttention()
    seen = attn.attn.seen
    hs, ehs, vid, txt = _attn_inputs(tiny_pipe.transformer)
    OPT.reset_stats()
    with runtime.context(), torch.no_grad():
        _stock_attn(attn, hs, ehs, vid, txt)
        attn(hs, ehs, vid, txt)
    assert OPT.stats["sp_calls"] == 1
    for a, b in zip(seen[0], seen[1], strict=True):
        assert torch.equal(a, b)
    # SP 1, the real attention: v reaches SDPA as a non-contiguous view of the joint projection, bitwise
    attn = _attn(tiny_pipe.transformer)
    got_v = []
    inner = attn.attn.forward

    def spy(q, k, v, md=None):
        got_v.append(v.is_contiguous())
        return inner(q, k, v, md)

    hs, ehs, vid, txt = _attn_inputs(tiny_pipe.transformer, batch=2)
    with runtime.context(), torch.no_grad():
        want = _stock_attn(attn, hs, ehs, vid, txt)
        attn.attn.forward = spy
        try:
            got = attn(hs, ehs, vid, txt)
        finally:
            del attn.attn.forward
    assert got_v == [False]  # v is a view of the joint projection
    assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))
    # quantized or LoRA-wrapped projections: the joint path calls them like stock and joins their outputs
    attn = _clone(_attn(tiny_pipe.transformer))
    width = attn.to_qkv.weight.shape[0]
    attn.to_qkv = _LoraLike(attn._modules["to_qkv"], attn.dim, width)
    attn.add_kv_proj = _LoraLike(attn._modules["add_kv_proj"], attn.dim, width)
    hs, ehs, vid, txt = _attn_inputs(tiny_pipe.transformer, txt=9)
    OPT.reset_stats()
    with runtime.context(), torch.no_grad():
        want = _stock_attn(attn, hs, ehs, vid, txt)
        got = attn(hs, ehs, vid, txt)
        plain = _attn(tiny_pipe.transformer)(hs, ehs, vid, txt)
    assert OPT.stats["joint_calls"] == 2 and OPT.fallback_reasons() == {}
    assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))
    assert not torch.equal(got[0], plain[0])  # the wrappers acted


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_peak_memory_of_an_attention_call_is_below_stocks_and_of_a_forward_not_above(
    runtime, tiny_pipe, bf16_transformer, dtype
):
    """The joint call frees the per-stream projections before the norms' temporaries and, where the norm upcasts
    (bf16), normalises q and k one after the other; a warm default forward never peaks above stock's."""
    tr = tiny_pipe.transformer if dtype == "fp32" else bf16_transformer
    hw = (16, 16) if dtype == "fp32" else (8, 8)
    attn = _attn(tr)
    hs, ehs, vid, txt = _attn_inputs(tr, txt=32, hw=hw)
    api.select("none,+joint_attention", model=tr)
    with runtime.context(), torch.no_grad():
        want, stock = measure(lambda: _stock_attn(attn, hs, ehs, vid, txt))
        attn(hs, ehs, vid, txt)  # the joint tables are built once per freqs: the warm call is measured
        OPT.reset_stats()
        got, joint = measure(lambda: attn(hs, ehs, vid, txt))
    assert OPT.stats["joint_calls"] == 1 and all(torch.equal(a, b) for a, b in zip(want, got, strict=True))
    # below, not equal: with the projections held through the norms the call's peak is exactly stock's
    assert joint.peak < stock.peak, (joint.peak, stock.peak)

    def call() -> torch.Tensor:
        return tiny_forward(runtime, tr, hw=hw, txt=32)

    want, stock = stock_then("default", tr, lambda: measure(call))
    call()  # tables and memo entries are made by the first forward of a shape: the warm forward is measured
    OPT.reset_stats()
    got, default = measure(call)
    assert OPT.stats["joint_calls"] == TINY.num_layers and torch.equal(want, got)
    assert default.peak <= stock.peak, (default.peak, stock.peak)


def _reason_for(runtime, transformer, edit, *, grad=False) -> dict[str, int]:
    api.select("none,+joint_attention", model=transformer)
    attn = _clone(_attn(transformer))
    edit(attn)
    hs, ehs, vid, txt = _attn_inputs(transformer)
    OPT.reset_stats()
    with runtime.context(), (torch.enable_grad if grad else torch.no_grad)():
        want = _stock_attn(attn, hs, ehs, vid, txt)
        got = attn(hs, ehs, vid, txt)
    assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))
    assert OPT.stats["joint_calls"] == 0
    return OPT.fallback_reasons()


def _identity_norms(attn):
    attn.norm_q, attn.norm_k = nn.Identity(), nn.Identity()
    attn.qk_norm = False


@pytest.mark.parametrize(
    ("edit", "fragment"),
    [
        (lambda attn: setattr(attn.norm_added_q, "eps", 1e-5), "different eps"),
        (lambda attn: attn.norm_k.register_forward_hook(lambda m, a, o: None), "hooks"),
        (_identity_norms, "not nn.RMSNorm"),
        (lambda attn: setattr(attn.norm_q, "weight", None), "without weight"),
    ],
)
def test_fallbacks_run_stock_with_a_reason(runtime, tiny_pipe, edit, fragment):
    reasons = _reason_for(runtime, tiny_pipe.transformer, edit)
    assert list(reasons) and fragment in next(iter(reasons)), reasons


def test_non_native_rope_mismatched_freqs_autograd_and_fused_cuda_fall_back(runtime, tiny_pipe, monkeypatch):
    api.select("none,+joint_attention", model=tiny_pipe)
    attn = _attn(tiny_pipe.transformer)
    hs, ehs, vid, txt = _attn_inputs(tiny_pipe.transformer)
    with torch.no_grad():
        assert OPT._call_reason(attn, hs, ehs, vid, txt) is None
        assert "freqs" in OPT._call_reason(attn, hs, ehs, vid[:-1], txt)
        assert "freqs" in OPT._call_reason(attn, hs, ehs, vid, txt.real)
        assert OPT._call_reason(attn, hs, ehs.double(), vid, txt) == "text and image hidden states differ in dtype"
    # an instance forward on the rope: stock's dispatch to the native rotary math is no longer provable
    attn.rope.forward = attn.rope.forward_native
    try:
        assert "device kernel" in ja.static_reason(attn)
        OPT.reset_stats()
        with runtime.context(), torch.no_grad():
            attn(hs, ehs, vid, txt)
        assert "device kernel" in next(iter(OPT.fallback_reasons()))
        assert OPT.reasons_inactive(nn.ModuleList([attn])) == [ja.static_reason(attn)]
    finally:
        del attn.rope.forward
    assert ja.static_reason(attn) is None
    reasons = _reason_for(runtime, tiny_pipe.transformer, lambda a: None, grad=True)
    assert reasons == {"autograd is recording": 1}  # the shared guard's words (blocks.guards.call_reason)
    # stock's fused CUDA QK-norm/RoPE path is left to stock, decided before the projections
    mod = sys.modules[_targets.TRANSFORMER]
    monkeypatch.setattr(mod, "_fused_cuda_supported", lambda *a, **k: True)
    monkeypatch.setattr(mod, "fused_qk_norm_rope_min_tokens", lambda default: 0)
    monkeypatch.setattr(mod, "fused_qk_norm_rope", lambda q, k, *a, **kw: (q, k))  # stand-in for the CUDA kernel
    calls = []
    hooks = [m.register_forward_hook(lambda *_: calls.append(1)) for m in (attn.to_qkv, attn.add_kv_proj)]
    OPT.reset_stats()
    try:
        with runtime.context(), torch.no_grad():
            why = OPT._call_reason(attn, hs, ehs, vid, txt)
            attn(hs, ehs, vid, txt)
    finally:
        for h in hooks:
            h.remove()
    assert isinstance(why, str) and "fused CUDA" in why
    assert "fused CUDA" in next(iter(OPT.fallback_reasons()))
    assert len(calls) == 2  # decided before the projections: stock computes each QKV GEMM once, not after ours


def _double_weights(attn) -> None:
    for name in ("norm_q", "norm_k", "norm_added_q", "norm_added_k"):
        norm = attn._modules[name]
        norm.weight = nn.Parameter(norm.weight.detach().double(), requires_grad=False)


def _k_eps(attn) -> None:
    for name in ("norm_k", "norm_added_k"):
        attn._modules[name].eps = 1e-2


@pytest.mark.parametrize("edit", [_double_weights, _k_eps], ids=["weights_not_in_opmath", "k_eps_differs"])
def test_per_tensor_norms_where_q_and_k_cannot_share_a_pass(runtime, tiny_pipe, monkeypatch, edit):
    """QK-norm weights outside the norm's opmath dtype, or q and k norms with different eps: q, then k, each with its
    own eps, bitwise stock; so is the compiled path's math (``traced_forward``, run eagerly)."""
    api.select("none,+joint_attention", model=tiny_pipe)
    attn = _clone(_attn(tiny_pipe.transformer))
    edit(attn)
    hs, ehs, vid, txt = _attn_inputs(tiny_pipe.transformer)
    calls = []
    per_tensor = ja.joint_rms_norm
    monkeypatch.setattr(ja, "joint_rms_norm", lambda *a: calls.append(a[-1]) or per_tensor(*a))
    OPT.reset_stats()
    with runtime.context(), torch.no_grad():
        want = _stock_attn(attn, hs, ehs, vid, txt)
        got = attn(hs, ehs, vid, txt)
        traced = joint_qkv.traced_forward(sys.modules[_targets.TRANSFORMER], attn, hs, ehs, vid, txt, None, None)
    assert OPT.stats["joint_calls"] == 1 and calls == [attn.norm_q.eps, attn.norm_k.eps]
    for out in (got, traced):
        assert all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(want, out, strict=True))


def test_joint_freqs_cache_is_an_lru_of_16_and_dies_with_either_freqs():
    """At most 16 joint freqs, least recently used evicted first; an entry dies with its vid or its txt freqs."""
    stats = OPT.stats.__class__()
    cache = ja._JointFreqsCache(stats)
    txt = torch.polar(torch.ones(3, 8), torch.rand(3, 8))
    vids = [torch.polar(torch.ones(4, 8), torch.full((4, 8), float(i))) for i in range(17)]
    first = [cache.joint(v, txt) for v in vids[:16]]
    assert len(cache) == 16 and torch.equal(first[0], torch.cat([txt, vids[0]]))
    assert cache.joint(vids[0], txt) is first[0]  # a hit: now the most recent; vids[1] is the least recently used
    cache.joint(vids[16], txt)  # the 17th: evicts vids[1]
    assert len(cache) == 16
    assert cache.joint(vids[0], txt) is first[0] and cache.joint(vids[2], txt) is first[2]
    assert cache.joint(vids[1], txt) is not first[1]  # evicted: built again
    assert stats["joint_freqs_builds"] == 18 and stats["joint_freqs_hits"] == 3
    n = len(cache)
    del vids[5], first  # one vid freqs dies (the joint tensors hold no reference to it)
    assert len(cache) == n - 1
    del txt  # the txt freqs of every entry dies
    assert len(cache) == 0


def test_with_rope_installed_the_joint_rotary_is_ropes_verified_kernel_and_bitwise_through_fused_attention(
    runtime, bf16_transformer, fake_npu
):
    """With ``rope`` installed the joint q/k go through its verified npu_rotary_mul and table cache, without it its
    own rotation; through ``fused_attention`` (npu_fusion_attention via the fake) the joint views give stock's."""
    rope = registry.get("rope")
    npu = fake_npu()
    layers = len(bf16_transformer.transformer_blocks)
    api.select("none,+rope,+joint_attention", model=bf16_transformer)
    tiny_forward(runtime, bf16_transformer, batch=2)
    assert OPT.stats["joint_calls"] == layers and OPT.fallback_reasons() == {}
    assert npu.calls["npu_rotary_mul"] == 1 + layers  # the verification, then q and k together per block
    assert rope.stats["kernel_calls"] == layers and rope.stats["table_builds"] == 1  # one joint table
    assert OPT.stats["table_builds"] == 0  # not joint_attention's own cache
    api.select("none,+joint_attention", model=bf16_transformer)
    OPT.reset_stats()
    tiny_forward(runtime, bf16_transformer, batch=2)
    assert npu.calls["npu_rotary_mul"] == 1 + layers and not rope.stats  # rope off: no kernel, nothing counted
    assert OPT.stats["joint_calls"] == layers and OPT.stats["table_builds"] == 1
    api.select("none,+fused_attention", model=bf16_transformer)
    ref = tiny_forward(runtime, bf16_transformer, batch=2, pad=True)
    api.select("none,+fused_attention,+joint_attention", model=bf16_transformer)
    OPT.reset_stats()
    got = tiny_forward(runtime, bf16_transformer, batch=2, pad=True)
    assert npu.calls["npu_fusion_attention"] > 0 and OPT.stats["joint_calls"] > 0
    assert torch.equal(ref, got)


def test_traced_attention_is_stock_and_counts_nothing(runtime, tiny_pipe, caplog):
    """Fullgraph tracing holds the joint path with hoisted RoPE tables (regional), stock's without (full), both with
    stock's values; no counter, fallback reason, cache entry or log line appears."""
    api.select("none", model=tiny_pipe)
    attn = _attn(tiny_pipe.transformer)
    hs, ehs, vid, txt = _attn_inputs(tiny_pipe.transformer)
    with runtime.context(), torch.no_grad():
        want = attn(hs, ehs, vid, txt)
    api.select("none,+joint_attention", model=tiny_pipe)
    OPT.reset_stats()

    def traced_norms(hoisted: bool) -> list[str]:
        graphs = []

        def backend(gm, example_inputs):
            graphs.append(gm)
            return gm.forward

        # what a regionally compiled block's eager pre-hook leaves: this forward's joint tables (full compile: none)
        tables = rope_tables.graph_tables(torch.cat([txt, vid], dim=0), hs.dtype) if hoisted else None
        compiled_blocks.set_ready(attn, READY_ROPE, tables)
        torch._dynamo.reset()
        try:
            with runtime.context(), torch.no_grad(), caplog.at_level(logging.DEBUG, logger="vllm_omni_ascend_opt"):
                got = torch.compile(attn, backend=backend, fullgraph=True)(hs, ehs, vid, txt)
        finally:
            torch._dynamo.reset()
            attn.__dict__.pop(READY_ROPE, None)
        assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))
        (gm,) = graphs
        return [str(n.target) for n in gm.graph.nodes if n.op == "call_function" and "rms_norm" in str(n.target)]

    assert len(traced_norms(hoisted=True)) == 2  # the joint q and k norms
    assert len(traced_norms(hoisted=False)) == 4  # full compile, no hoisted tables: stock's four per-stream norms
    assert not OPT.stats and OPT.fallback_reasons() == {} and len(OPT._joint_freqs) == 0 and len(OPT._tables) == 0
    assert not caplog.records
    with runtime.context(), torch.no_grad():
        again = attn(hs, ehs, vid, txt)  # eager: the joint path (the patch was in place while tracing)
    assert OPT.stats["joint_calls"] == 1 and all(torch.equal(a, b) for a, b in zip(want, again, strict=True))
