"""`rope`: cos/sin table reuse (bitwise-exact on CPU) and the verified npu_rotary_mul path (through the fake).

Op counts use the project's counter (views excluded); the fake's kernel is one ``torch.library`` op: one launch."""

from __future__ import annotations

import logging
import math
import sys
from collections import Counter
from types import SimpleNamespace

import pytest
import torch
from torch.overrides import TorchFunctionMode

from tests.fake_torch_npu import rotary as fake_rotary
from tests.harness.forward import tiny_forward
from tests.harness.stock import stock_then
from vllm_omni_ascend_opt import api, cli
from vllm_omni_ascend_opt.blocks.kernels import rope_tables, rotary
from vllm_omni_ascend_opt.blocks.upstream import targets as _targets
from vllm_omni_ascend_opt.opts import rope as rope_mod
from vllm_omni_ascend_opt.testbed import TINY
from vllm_omni_ascend_opt.testbed.opcount import OpCounter, count_module_calls
from vllm_omni_ascend_opt.testbed.pipeline import generate

OPT = rope_mod.OPT


# ----- helpers --------------------------------------------------------------------------------------------------------
class _ConversionCounter(TorchFunctionMode):
    """Counts freqs -> cos/sin conversions (``torch.real`` / ``torch.imag`` on complex tensors)."""

    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in (torch.real, torch.imag) and args and args[0].is_complex():
            self.n += 1
        return func(*args, **(kwargs or {}))


def _block_ops(rt, transformer) -> int:
    """Kernel launches of the last block in one (warm) forward."""
    tiny_forward(rt, transformer)  # warm: tables, verification
    with count_module_calls(transformer.transformer_blocks[-1]) as res:
        tiny_forward(rt, transformer)
    assert len(res) == 1
    return res[0].total


# ----- patch mechanics ------------------------------------------------------------------------------------------------
def test_install_and_uninstall_restore_by_identity(tiny_pipe):
    mod = sys.modules[_targets.TRANSFORMER]
    orig_fn, orig_fwd = mod._qwen_image_qk_norm_rope, mod.QwenEmbedRope.forward
    orig_fwd3d = mod.QwenEmbedLayer3DRope.forward
    api.select("none,+rope", model=tiny_pipe)
    assert OPT.installed
    assert mod._qwen_image_qk_norm_rope is not orig_fn and mod._qwen_image_qk_norm_rope.__wrapped__ is orig_fn
    assert mod.QwenEmbedRope.forward.__wrapped__ is orig_fwd
    assert OPT.patches.is_patched(mod, "_qwen_image_qk_norm_rope")
    api.select("none,+rope", model=tiny_pipe)  # idempotent
    assert len(OPT.patches) == 3
    assert OPT.reasons_inactive(tiny_pipe) == []
    assert OPT.reasons_inactive(torch.nn.Linear(2, 2))
    api.select("none", model=tiny_pipe)
    assert mod._qwen_image_qk_norm_rope is orig_fn
    assert mod.QwenEmbedRope.forward is orig_fwd and mod.QwenEmbedLayer3DRope.forward is orig_fwd3d


# ----- bitwise equality with stock (portable path) --------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("batch", "pad"), [(1, False), (2, False), (2, True)], ids=["b1", "b2", "b2-padded"])
def test_transformer_output_bitwise(runtime, tiny_pipe, bf16_transformer, dtype, batch, pad):
    t = tiny_pipe.transformer if dtype == torch.float32 else bf16_transformer
    shapes = [(4, 4), (4, 6), (4, 4)]  # two resolutions, then back to the first (table reuse across requests)
    api.select("none", model=tiny_pipe)
    ref = [tiny_forward(runtime, t, batch=batch, hw=hw, pad=pad) for hw in shapes]
    api.select("none,+rope", model=tiny_pipe)
    got = [tiny_forward(runtime, t, batch=batch, hw=hw, pad=pad) for hw in shapes]
    got.append(tiny_forward(runtime, t, batch=batch, hw=shapes[0], pad=pad))  # warm repeat
    assert all(torch.equal(a, b) for a, b in zip(ref, got[:3], strict=True))
    assert torch.equal(ref[0], got[3])
    assert OPT.stats["portable_calls"] > 0 and OPT.stats["stock_calls"] == 0
    assert OPT.stats["embed_memo_hits"] >= 2  # the same freqs objects come back for a repeated shape


@pytest.mark.parametrize("cfg", [1.0, 3.0], ids=["cfg-off", "true-cfg"])
def test_pipeline_images_bitwise_and_runtime_toggle(runtime, tiny_pipe, cfg):
    def run():
        return [generate(tiny_pipe, runtime, height=h, width=w, **kw).images for h, w in ((32, 32), (32, 48))]

    kw = dict(steps=2, seed=3, cfg_scale=cfg)
    api.select("none", model=tiny_pipe)
    ref = run()
    with api.optimizations("none,+rope", model=tiny_pipe):  # on the built pipeline, then off again
        assert all(torch.equal(a, b) for a, b in zip(ref, run(), strict=True))
        assert OPT.stats["portable_calls"] > 0
    assert not OPT.installed
    assert all(torch.equal(a, b) for a, b in zip(ref, run(), strict=True))


def test_inference_mode_bitwise_and_tables_reused_across_steps(runtime, tiny_pipe):
    """vLLM-Omni's model runner uses inference_mode (tensors without version counters)."""
    t = tiny_pipe.transformer
    api.select("none", model=tiny_pipe)
    ref = [tiny_forward(runtime, t, hw=hw, mode=torch.inference_mode) for hw in ((4, 4), (6, 4))]
    api.select("none,+rope", model=tiny_pipe)
    got = [tiny_forward(runtime, t, hw=hw, mode=torch.inference_mode) for hw in ((4, 4), (6, 4))]
    builds = OPT.stats["table_builds"]
    again = tiny_forward(runtime, t, hw=(4, 4), mode=torch.inference_mode)
    assert all(torch.equal(a, b) for a, b in zip(ref, got, strict=True)) and torch.equal(ref[0], again)
    assert builds == 4 and OPT.stats["table_builds"] == builds  # 2 shapes x (vid, txt); none on the repeat


@pytest.mark.parametrize("cls_name", ["QwenEmbedRope", "QwenEmbedLayer3DRope"])
def test_embed_memo_returns_same_freqs_for_same_arguments_an_lru_of_8_results_per_module(tiny_pipe, cls_name):
    """At most 8 results per embedder module (another module's do not count); a hit is the most recent; LRU eviction."""
    mod = sys.modules[_targets.TRANSFORMER]
    api.select("none,+rope")
    cls = getattr(mod, cls_name)
    emb, lru, other = (cls(theta=10000, axes_dim=list(TINY.axes_dims_rope), scale_rope=True) for _ in range(3))
    cpu = torch.device("cpu")
    shapes = [[(1, 4, 6), (1, 4, 6)]] if cls_name == "QwenEmbedLayer3DRope" else [[(1, 4, 6)]]
    with torch.no_grad():
        a = emb(shapes, [7], cpu)
        b = emb(shapes, [7], cpu)
        c = emb(shapes, [9], cpu)
        want = cls.forward.__wrapped__(emb, shapes, [9], cpu)
    assert a is b and c is not a and OPT.stats["embed_memo_hits"] == 1
    assert torch.equal(c[0], want[0]) and torch.equal(c[1], want[1])
    emb.pos_freqs = emb.pos_freqs.clone()  # new tables object: never the stale memo
    with torch.no_grad():
        assert emb(shapes, [7], cpu) is not a
        first = [lru(shapes, [n], cpu) for n in range(1, 9)]  # 8 text lengths
        assert [lru(shapes, [n], cpu) for n in range(1, 9)] == first and OPT.stats["embed_memo_hits"] == 1 + 8
        for n in range(1, 10):
            other(shapes, [n], cpu)  # another module: its own memo
        assert all(lru(shapes, [n], cpu) is first[n - 1] for n in range(1, 9))
        hits = OPT.stats["embed_memo_hits"]
        assert lru(shapes, [1], cpu) is first[0]  # now the most recent; [2] is the least recently used
        lru(shapes, [9], cpu)  # a 9th result: evicts [2]
        assert lru(shapes, [1], cpu) is first[0] and lru(shapes, [3], cpu) is first[2]
        assert lru(shapes, [2], cpu) is not first[1]  # evicted: recomputed
    assert OPT.stats["embed_memo_hits"] == hits + 3


def test_stock_kernel_with_cached_tables_when_stock_is_not_forward_native(runtime, tiny_pipe, monkeypatch):
    """Where stock dispatches RotaryEmbedding elsewhere (MindIE-SD, CUDA), that kernel gets the cached cos/sin."""
    rope = tiny_pipe.transformer.transformer_blocks[0].attn.rope
    api.select("none", model=tiny_pipe)
    monkeypatch.setattr(rope, "_forward_method", rope.forward_cuda)  # on CPU: apply_rotary_emb_torch
    ref = tiny_forward(runtime, tiny_pipe.transformer)
    api.select("none,+rope", model=tiny_pipe)
    got = tiny_forward(runtime, tiny_pipe.transformer)
    assert torch.equal(ref, got)
    assert OPT.stats["delegate_calls"] == 4 and OPT.stats["portable_calls"] == 4  # block 0 vs block 1


def test_grad_mode_runs_stock(runtime, tiny_pipe):
    api.select("none,+rope", model=tiny_pipe)
    t = tiny_pipe.transformer
    mod = sys.modules[_targets.TRANSFORMER]
    q = torch.randn(1, 16, 4, 16)
    freqs = torch.polar(torch.ones(16, 8), torch.rand(16, 8))
    attn = t.transformer_blocks[0].attn
    args = (q, q.clone(), attn.norm_q, attn.norm_k, freqs, attn.rope, attn.eps)
    with torch.enable_grad():
        a = mod._qwen_image_qk_norm_rope(*args)
    with torch.no_grad():
        b = mod._qwen_image_qk_norm_rope(*args)
    assert OPT.stats["stock_calls"] == 1 and OPT.stats["portable_calls"] == 2
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


# ----- counting -------------------------------------------------------------------------------------------------------
def test_cos_sin_conversions_per_forward(runtime, tiny_pipe):
    t = tiny_pipe.transformer
    blocks = len(t.transformer_blocks)

    def conversions(hw):
        with _ConversionCounter() as c:
            tiny_forward(runtime, t, hw=hw)
        return c.n

    api.select("none", model=tiny_pipe)
    assert conversions((4, 4)) == blocks * 2 * 2  # per block: img + txt, real + imag
    api.select("none,+rope", model=tiny_pipe)
    assert conversions((4, 4)) == 2 * 2  # once per shape: vid + txt tables
    assert conversions((4, 4)) == 0  # next step / request: same shape, same tables
    assert conversions((4, 6)) == 2 * 2  # new resolution: new vid table; txt offset moves with max(h, w) // 2
    assert conversions((4, 4)) == 0  # the first shape's tables are still cached


def test_op_counts_per_block(runtime, tiny_pipe, fake_npu):
    """Stock vs rope (portable) vs rope (fake NPU) on the tiny config; rope's own share of the block."""
    t = tiny_pipe.transformer
    stock = stock_then("none,+rope", tiny_pipe, lambda: _block_ops(runtime, t))
    portable = _block_ops(runtime, t)
    npu = fake_npu()
    api.select("none", model=tiny_pipe)
    api.select("none,+rope", model=tiny_pipe)
    kernel = _block_ops(runtime, t)
    assert npu.calls["npu_rotary_mul"] > 0
    # stock: 4 rope calls x 10 launches (2 repeats, neg, stack, 2 mul, add, cat, +2 views counted as _unsafe_view)
    assert stock - portable == 24  # 4 calls x (10 -> 4)
    assert stock - kernel == 36  # 4 calls x (10 -> 1)
    assert kernel <= 70


# ----- table cache keys -----------------------------------------------------------------------------------------------
def test_table_key_separates_sp_shards_paddings_versions_and_text_lengths():
    stats = Counter()
    cache = rope_tables.TableCache(stats)
    full = torch.polar(torch.ones(10, 4), torch.rand(10, 4))
    r0, r1 = full.chunk(2, dim=0)  # two SP ranks' views of the same base
    padded = torch.cat([full, torch.zeros(2, 4, dtype=full.dtype)]).chunk(2, dim=0)[1]
    t0, t1, tp = cache.get(r0, torch.float32), cache.get(r1, torch.float32), cache.get(padded, torch.float32)
    assert len({id(t0), id(t1), id(tp)}) == 3
    for t, f in ((t0, r0), (t1, r1), (tp, padded)):
        cos, _ = rope_tables.half_tables(t, f, stats)
        assert torch.equal(cos, torch.real(f))
    assert cache.get(full.chunk(2, dim=0)[0], torch.float32) is t0  # a new view object of the same shard: reused
    assert cache.get(r0, torch.bfloat16) is not t0  # per dtype
    full.mul_(1)  # in-place write: version bump, never a stale table
    assert cache.get(r0, torch.float32) is not t0
    with torch.inference_mode():  # no version counters: keyed by identity
        a = torch.polar(torch.ones(6, 4), torch.rand(6, 4))
        b = a.clone()
        assert cache.get(a, torch.float32) is cache.get(a, torch.float32)
        assert cache.get(b, torch.float32) is not cache.get(a, torch.float32)
    n = len(cache)
    del full, r0, r1, padded, t0, t1, tp, a, b
    assert len(cache) < n  # entries die with their freqs
    # text freqs are slices of one pos_freqs: 7 and 9 tokens share base, offset and stride; only the shape differs
    pos = torch.polar(torch.ones(32, 4), torch.rand(32, 4))
    t7, t9 = cache.get(pos[3:10], torch.float32), cache.get(pos[3:12], torch.float32)
    assert t7 is not t9 and cache.get(pos[3:10], torch.float32) is t7


def test_text_lengths_7_9_7_at_one_image_size_bitwise(runtime, tiny_pipe):
    """Each forward equals stock (no length gets another's text tables); the repeated 7-token shape reuses them."""
    t = tiny_pipe.transformer
    lengths = (7, 9, 7)
    want = stock_then("none,+rope", tiny_pipe, lambda: [tiny_forward(runtime, t, txt=n, hw=(4, 4)) for n in lengths])
    got = [tiny_forward(runtime, t, txt=n, hw=(4, 4)) for n in lengths]
    for n, g, w in zip(lengths, got, want, strict=True):
        assert torch.equal(g, w), n
    assert OPT.stats["table_hits"] > 0


def test_table_cache_is_an_lru_of_32_entries():
    """At most 32 tables; a hit makes its entry the most recent; a new one beyond the cap evicts the oldest."""
    stats = Counter()
    cache = rope_tables.TableCache(stats)
    freqs = [torch.polar(torch.ones(2, 2), torch.full((2, 2), float(i))) for i in range(34)]
    first = [cache.get(f, torch.float32) for f in freqs[:32]]
    assert len(cache) == 32 and len({id(t) for t in first}) == 32
    assert cache.get(freqs[0], torch.float32) is first[0] and stats["table_hits"] == 1  # now the most recent
    cache.get(freqs[32], torch.float32)  # the 33rd: evicts the least recently used, freqs[1]
    assert len(cache) == 32
    assert cache.get(freqs[0], torch.float32) is first[0]  # kept: its hit made it recent
    assert cache.get(freqs[2], torch.float32) is first[2]  # kept: not the oldest
    assert cache.get(freqs[1], torch.float32) is not first[1]  # evicted: a new, empty entry (evicts freqs[3])
    assert cache.get(freqs[3], torch.float32) is not first[3] and len(cache) == 32
    assert stats["table_hits"] == 3


# ----- NPU path through the fake torch_npu ----------------------------------------------------------------------------
def _spy(npu):
    seen = []
    inner = npu.npu_rotary_mul

    def spy(x, r1, r2, **kw):
        out = inner(x, r1, r2, **kw)
        seen.append((x, r1, r2, kw, out))
        return out

    npu.npu_rotary_mul = spy
    return seen


def test_npu_path_uses_interleave_and_1s1d_tables_verified_once_per_dtype(
    runtime, tiny_pipe, bf16_transformer, fake_npu
):
    npu = fake_npu()
    seen = _spy(npu)
    trs = {torch.float32: tiny_pipe.transformer, torch.bfloat16: bf16_transformer}
    refs = stock_then(
        "none,+rope", tiny_pipe, lambda: {d: tiny_forward(runtime, t, batch=2, pad=True) for d, t in trs.items()}
    )
    verified = []
    for dtype, t in [*trs.items(), *trs.items()]:  # twice each: verified on first use per dtype only
        start = len(seen)
        got = tiny_forward(runtime, t, batch=2, pad=True)
        verified += [c[0].dtype for c in seen[start:] if c[0].shape[1] == 37]  # verify_kernel's S
        calls = [c for c in seen[start:] if c[0].shape[1] != 37]
        assert len(calls) == 4 * len(t.transformer_blocks)
        for x, r1, r2, kw, out in calls:
            assert kw == {"rotary_mode": "interleave"}
            _, s, _, d = x.shape
            assert r1.shape == r2.shape == (1, s, 1, d) and r1.dtype == x.dtype == dtype
            # each call agrees with the portable (stock-equal) path within the verification bound
            cos, sin_signed = r1[0], torch.stack((-r2[0, :, :, ::2], r2[0, :, :, 1::2]), dim=-1).flatten(-2)
            ref32, scale = rotary.reference_fp32(x, cos, sin_signed)
            err = (out.float() - ref32).abs()
            assert bool((err <= rotary.TOLERANCE_EPS_FACTOR * torch.finfo(dtype).eps * scale + 1e-38).all())
        if dtype == torch.float32:
            assert torch.equal(refs[dtype], got)  # fp32 kernel == fp32 small ops here
        else:  # a fused fp32-inside kernel is not bitwise in bf16: the default (pixel) policy takes it
            torch.testing.assert_close(got.float(), refs[dtype].float(), atol=3e-2, rtol=3e-2)
    assert verified == [torch.float32, torch.bfloat16]
    assert OPT.stats["kernel_calls"] == len(seen) - 2 and OPT.stats["portable_calls"] == 0
    v = OPT.verdicts()
    assert len(v) == 2 and all(x.ok for x in v), OPT.notes()
    assert {x.key[:2] for x in v} == {("cpu", torch.float32), ("cpu", torch.bfloat16)}
    assert any("verified" in n and "in use" in n for n in OPT.notes())


@pytest.mark.parametrize(
    ("variant", "dtype", "why"),
    [
        ("raises", torch.float32, "raised RuntimeError"),
        ("no_rotary_mode", torch.float32, "raised TypeError"),
        ("aclop", torch.float32, "aclop only support rotary_mode with half"),  # op-plugin >= 7.0: raises
        ("low_precision", torch.float32, "tolerance"),  # fp16 inside: far outside the fp32 bound
    ],
)
def test_bad_kernels_stay_off_with_reason(runtime, tiny_pipe, fake_npu, variant, dtype, why):
    fake_npu(rotary_mul=variant)
    ref = stock_then("none,+rope", tiny_pipe, lambda: tiny_forward(runtime, tiny_pipe.transformer))
    got = tiny_forward(runtime, tiny_pipe.transformer)
    assert torch.equal(ref, got)
    if variant in ("raises", "aclop"):  # a RuntimeError: a fault of the moment (retried with backoff), no verdict
        assert OPT.verdicts() == [] and [f.kind for f in OPT.rotary.guard.faults()] == ["runtime error"]
    else:
        (v,) = OPT.verdicts()
        assert not v.ok and why in v.reason
    assert any(why in n for n in OPT.notes())


@pytest.mark.parametrize("variant", ["low_precision", "small_ops"])
def test_bf16_kernel_policy_pixel_takes_either_bitwise_only_small_ops(
    runtime, bf16_transformer, fake_npu, monkeypatch, variant
):
    """fp16-inside (within bf16's bound): ``pixel`` (default) takes it, ``bitwise`` not; a small-ops one: both do."""
    assert OPT.require_bitwise_kernel is None and not OPT.requires_bitwise()  # the shipped default: pixel
    bitwise = variant == "small_ops"
    npu = fake_npu(rotary_mul=variant)
    ref = stock_then("none,+rope", None, lambda: tiny_forward(runtime, bf16_transformer))
    got = tiny_forward(runtime, bf16_transformer)
    (v,) = OPT.verdicts()
    assert v.ok and v.bitwise is bitwise and v.errors["kernel"] <= v.errors["stock"]
    assert npu.calls["npu_rotary_mul"] > 1 and OPT.stats["kernel_calls"] > 0
    assert torch.equal(ref, got) or not bitwise
    api.select("none")
    monkeypatch.setenv(rope_mod.ENV_KERNEL_POLICY, "bitwise")
    api.select("none,+rope")
    got = tiny_forward(runtime, bf16_transformer)
    (v,) = OPT.verdicts()
    assert v.ok is bitwise and torch.equal(ref, got)
    if not bitwise:
        assert "not bitwise" in v.reason and rope_mod.ENV_KERNEL_POLICY in v.reason
        assert OPT.tier() == "exact"  # stayed on the portable path


def test_default_bf16_stack_uses_the_kernel_and_reports_pixel(runtime, bf16_transformer, fake_npu, capsys):
    """Without torch_npu rope is active, ``exact``, says why; in bf16 via the fake it runs the kernel: ``pixel``."""
    assert OPT.tier() == "exact"  # no torch_npu here: portable path
    api.select("default")
    row = next(r for r in api.status() if r["name"] == "rope")
    assert row["active"] and row["reasons_inactive"] == []
    assert row["tier"] == "exact" and row["equivalence"] == "pixel"  # portable path here; pixel with the kernel
    assert "npu_rotary_mul not in use" in " ".join(row["notes"]) and "torch_npu" in " ".join(row["notes"])
    assert all(v == "supported" for v in row["parallel_support"].values())
    npu = fake_npu()
    api.select("default")
    assert OPT.tier() == "pixel"
    ref = tiny_forward(runtime, bf16_transformer)
    assert npu.calls["npu_rotary_mul"] > 1 and OPT.stats["kernel_calls"] > 0
    (v,) = OPT.verdicts()
    assert v.ok and not v.bitwise  # fp32 inside: not stock's three bf16 roundings
    assert all(sv.ok and not sv.bitwise for sv in OPT.shape_verdicts())
    row = next(r for r in api.status() if r["name"] == "rope")
    assert row["tier"] == "pixel" and row["equivalence"] == "pixel" and row["active"]
    cli.main(["list"])
    assert any(line.split()[:2] == ["rope", "pixel"] for line in capsys.readouterr().out.splitlines())
    api.select("none")
    stock = tiny_forward(runtime, bf16_transformer)
    assert not torch.equal(ref, stock)  # float outputs differ: the pixel tier, not exact
    torch.testing.assert_close(ref.float(), stock.float(), atol=3e-2, rtol=3e-2)


def test_kernel_failure_in_use_falls_back(runtime, tiny_pipe, fake_npu, caplog, monkeypatch):
    """A real call that raises falls back to the portable path for its shape class, with the reason logged."""
    npu = fake_npu()
    new_hw = (3, 3)
    ref = stock_then("none,+rope", tiny_pipe, lambda: tiny_forward(runtime, tiny_pipe.transformer, hw=new_hw))
    tiny_forward(runtime, tiny_pipe.transformer)  # verified and used
    (v,) = OPT.verdicts()
    assert v.ok and npu.calls["npu_rotary_mul"] == 1 + 8

    def boom(*a, **k):
        raise RuntimeError("device lost")

    real = npu.npu_rotary_mul
    monkeypatch.setattr(npu, "npu_rotary_mul", boom)
    with caplog.at_level(logging.WARNING, logger="vllm_omni_ascend_opt"):
        got = tiny_forward(runtime, tiny_pipe.transformer, hw=new_hw)
    assert torch.equal(ref, got)
    faults = OPT.rotary.guard.faults()  # an error is not a verdict: both classes wait for their retry
    assert {f.key[4] for f in faults} == {16, 8} and all("device lost" in f.error for f in faults)
    assert all(sv.ok for sv in OPT.shape_verdicts()) and "device lost" in caplog.text
    monkeypatch.setattr(npu, "npu_rotary_mul", real)  # the device is back: the next forward retries, keeps it
    calls = OPT.stats["kernel_calls"]
    assert torch.equal(tiny_forward(runtime, tiny_pipe.transformer, hw=new_hw), ref)
    assert OPT.stats["kernel_calls"] > calls and OPT.rotary.guard.faults() == []


# ----- the fake itself: documented semantics and constraints ----------------------------------------------------------
def _doc_formula(x, r1, r2, mode):
    """[OP-ROT] small-op formula (einops rearrange written with stack/flatten)."""
    if mode == "half":
        x1, x2 = torch.chunk(x, 2, -1)
        rot = torch.cat((-x2, x1), dim=-1)
    else:
        rot = torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)
    return r1 * x + r2 * rot


@pytest.mark.parametrize("mode", ["half", "interleave"])
def test_fake_computes_the_documented_result(mode):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 3, 8, generator=g, dtype=torch.float64).float()
    r1, r2 = torch.rand(1, 5, 1, 8, generator=g) * 2 - 1, torch.rand(1, 5, 1, 8, generator=g) * 2 - 1
    out = fake_rotary.npu_rotary_mul(x, r1, r2, rotary_mode=mode)
    torch.testing.assert_close(out, _doc_formula(x, r1, r2, mode), rtol=0, atol=1e-6)
    xb = x.bfloat16()
    ob = fake_rotary.npu_rotary_mul(xb, r1.bfloat16(), r2.bfloat16(), rotary_mode=mode)
    assert ob.dtype == torch.bfloat16 and ob.shape == xb.shape
    assert torch.equal(ob, _doc_formula(xb.float(), r1.bfloat16().float(), r2.bfloat16().float(), mode).bfloat16())
    wrong = fake_rotary.npu_rotary_mul_half_pairing(x, r1, r2, rotary_mode="interleave")
    assert not torch.allclose(wrong, _doc_formula(x, r1, r2, "interleave"))
    with OpCounter() as c:
        fake_rotary.npu_rotary_mul(x, r1, r2, rotary_mode=mode)
    assert c.total == 1  # one launch


def _ok(shape_x, shape_r, mode="interleave", dtype=torch.float32):
    x, r = torch.zeros(shape_x, dtype=dtype), torch.zeros(shape_r, dtype=dtype)
    return fake_rotary.npu_rotary_mul(x, r, r, rotary_mode=mode)


@pytest.mark.parametrize(
    ("shape_x", "shape_r", "mode"),
    [
        ((2, 4, 3, 8), (1, 4, 1, 8), "interleave"),  # BSND + 1S1D
        ((2, 3, 4, 8), (1, 1, 4, 8), "interleave"),  # BNSD + 11SD
        ((4, 2, 3, 8), (4, 1, 1, 8), "interleave"),  # SBND + S11D
        ((6, 3, 8), (6, 1, 8), "interleave"),  # TND + T1D (3D input)
        ((2, 4, 3, 8), (2, 4, 1, 8), "half"),  # BSND + BS1D: half only
        ((6, 3, 8), (6, 3, 8), "half"),  # TND + TND: half only
        ((1, 1, 999, 2), (1, 1, 1, 2), "interleave"),  # B*N = 999
        ((999, 4, 3, 8), (1, 4, 1, 8), "half"),  # B = 999
        ((1, 1, 1, 894), (1, 1, 1, 894), "interleave"),  # D = 894
    ],
)
def test_fake_accepts_documented_shapes(shape_x, shape_r, mode):
    assert _ok(shape_x, shape_r, mode).shape == shape_x


@pytest.mark.parametrize(
    ("shape_x", "shape_r", "mode", "dtype", "match"),
    [
        ((4, 8), (4, 8), "interleave", torch.float32, "3D or 4D"),
        ((1, 2, 3, 4, 8), (1, 2, 1, 1, 8), "interleave", torch.float32, "3D or 4D"),
        ((2, 4, 3, 8), (1, 4, 1, 8), "interleave", torch.float64, "dtype"),
        ((2, 4, 3, 8), (1, 4, 1, 8), "interleave", torch.int32, "dtype"),
        ((2, 4, 3, 7), (1, 4, 1, 7), "half", torch.float32, "even"),
        ((1, 1, 1, 896), (1, 1, 1, 896), "interleave", torch.float32, "< 896"),
        ((2, 4, 3, 8), (2, 4, 1, 8), "interleave", torch.float32, "not one of"),  # BS1D: half only
        ((2, 4, 3, 8), (1, 4, 3, 8), "interleave", torch.float32, "not one of"),
        ((6, 3, 8), (6, 3, 8), "interleave", torch.float32, "T1D"),  # TND: only T1D in interleave
        ((2, 4, 3, 8), (1, 4, 1, 4), "interleave", torch.float32, "last dim"),
        ((1, 1, 1000, 2), (1, 1, 1, 2), "interleave", torch.float32, "B\\*N=1000"),
        ((20, 1, 50, 2), (1, 1, 1, 2), "interleave", torch.float32, "B\\*N=1000"),
        ((1000, 4, 3, 8), (1, 4, 1, 8), "half", torch.float32, "B=1000"),
        ((2, 4, 3, 8), (1, 4, 1, 8), "rotate", torch.float32, "half or interleave"),
    ],
)
def test_fake_raises_on_documented_violations(shape_x, shape_r, mode, dtype, match):
    with pytest.raises(fake_rotary.FakeNpuError, match=match):
        _ok(shape_x, shape_r, mode, dtype)


def test_fake_rejects_out_of_range_tables_and_mismatched_r():
    x = torch.zeros(1, 4, 2, 8)
    with pytest.raises(fake_rotary.FakeNpuError, match=r"\[-1, 1\]"):
        fake_rotary.npu_rotary_mul(x, torch.full((1, 4, 1, 8), 1.5), torch.zeros(1, 4, 1, 8), rotary_mode="interleave")
    with pytest.raises(fake_rotary.FakeNpuError, match="differ"):
        fake_rotary.npu_rotary_mul(x, torch.zeros(1, 4, 1, 8), torch.zeros(1, 1, 2, 8), rotary_mode="half")
    with pytest.raises(TypeError):
        fake_rotary.npu_rotary_mul_no_rotary_mode(x, torch.zeros(1, 4, 1, 8), torch.zeros(1, 4, 1, 8), rotary_mode="x")


def _path(bitwise: bool = False) -> rotary.RotaryPath:
    """A rotary kernel path of its own (not rope's), with the given policy."""
    policy = SimpleNamespace(use_npu_kernel=True, requires_bitwise=lambda: bitwise)
    return rotary.RotaryPath(policy, Counter(), "test")


def test_verification_bound_is_tight_enough_to_catch_one_swapped_pair_and_its_reference_is_chunked(monkeypatch):
    """Even a kernel wrong in a single adjacent pair of one head is refused; the fp32 reference of the shape check is
    computed over S in chunks (bounded memory at production shapes)."""

    def one_pair_wrong(x, r1, r2, rotary_mode):
        out = fake_rotary.npu_rotary_mul(x, r1, r2, rotary_mode=rotary_mode).clone()
        out[..., 0, 0:2] = out[..., 0, 0:2].flip(-1)
        return out

    v = _path().first_check(one_pair_wrong, torch.device("cpu"), torch.bfloat16, 16, 4)
    assert not v.ok and v.errors["over_bound"] > 1
    v = _path().first_check(fake_rotary.npu_rotary_mul_half_pairing, torch.device("cpu"), torch.float32, 16, 4)
    assert not v.ok and "wrong pairing" in v.reason and v.errors["over_bound"] > 100
    v = _path().first_check(fake_rotary.npu_rotary_mul, torch.device("cpu"), torch.bfloat16, 128, 24)
    assert v.ok and 0 < v.errors["over_bound"] <= 1 and math.isfinite(v.errors["over_bound"])
    b, s, n, d = 1, 40, 2, 8
    monkeypatch.setattr(rotary, "VERIFY_CHUNK_ELEMS", b * n * d * 8)
    seen = []
    real = rotary.reference_fp32
    monkeypatch.setattr(rotary, "reference_fp32", lambda x, c, sn: seen.append(x.shape[1]) or real(x, c, sn))
    x = torch.randn(b, s, n, d)
    theta = torch.rand(s, d // 2)
    t = rope_tables.Tables(torch.float32)
    cos, sin_signed = rope_tables.portable_tables(t, torch.polar(torch.ones_like(theta), theta), Counter())
    sv = _path(bitwise=True).class_check(x, rope_tables.apply_portable(x, cos, sin_signed), cos, sin_signed)
    assert sv.ok and sv.bitwise and seen == [8] * 5


@pytest.mark.parametrize(
    ("value", "want"),
    [(None, False), ("pixel", False), ("bitwise", True), ("verified", False), (" Verified ", False), ("nope", True)],
)
def test_kernel_policy_from_env(monkeypatch, value, want):
    if value is None:
        monkeypatch.delenv(rope_mod.ENV_KERNEL_POLICY, raising=False)
    else:
        monkeypatch.setenv(rope_mod.ENV_KERNEL_POLICY, value)
    assert OPT.requires_bitwise() is want
    if value == "nope":
        assert any("'nope' is not one of" in n for n in OPT.notes())
    monkeypatch.setattr(OPT, "require_bitwise_kernel", False)  # an explicit setting wins
    assert OPT.requires_bitwise() is False


def test_graph_capture_takes_the_stock_path(runtime, tiny_pipe, fake_npu, monkeypatch):
    """During NPU graph capture (the shared probe in _backend) rope neither verifies nor uses tables: stock code."""
    npu = fake_npu()
    ref = stock_then("none,+rope", tiny_pipe, lambda: tiny_forward(runtime, tiny_pipe.transformer))
    monkeypatch.setattr(torch.npu, "is_current_stream_capturing", lambda: True, raising=False)
    got = tiny_forward(runtime, tiny_pipe.transformer)
    assert torch.equal(ref, got)
    assert OPT.stats["stock_calls"] > 0 and OPT.stats["kernel_calls"] == 0 and OPT.stats["portable_calls"] == 0
    assert npu.calls["npu_rotary_mul"] == 0
