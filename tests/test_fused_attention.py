"""`fused_attention`: npu_fusion_attention (BSND) per model instance, verified against SDPA, on the real vLLM-Omni
classes through the torch_npu fake; the bf16 model takes the kernel path, the float32 ``tiny_pipe`` stays stock."""

from __future__ import annotations

import json
import math

import pytest
import torch

from tests.fake_torch_npu.formats import FakeNpuError
from tests.harness.forward import fwd, inputs
from vllm_omni_ascend_opt import api
from vllm_omni_ascend_opt.blocks.kernels import npu_attention as fab
from vllm_omni_ascend_opt.opts import fused_attention as fa
from vllm_omni_ascend_opt.opts import rope as rope_mod
from vllm_omni_ascend_opt.testbed.opcount import count_module_calls
from vllm_omni_ascend_opt.testbed.pipeline import generate, load_pipeline

OPT = fa.OPT
B, TXT, IMG_HW = 2, 7, (4, 4)  # 2 prompts, 7 text tokens, 4x4 latent patches (a 64x64 image)
HEADS, HEAD_DIM = 4, 16  # the tiny test-bed transformer


def run_transformer(tr, runtime, *, masked: bool, seed: int = 0, pad: int = 5) -> torch.Tensor:
    """``B`` prompts; with ``masked`` the second keeps only its first ``pad`` text tokens (a padded text mask)."""
    kw = inputs(tr.proj_out.weight.dtype, B, IMG_HW, TXT, pad=TXT - pad, seed=seed)
    if not masked:
        kw["encoder_hidden_states_mask"] = None
    return fwd(tr, runtime, kw)


def _layers(tr):
    from vllm_omni.diffusion.models.qwen_image.qwen_image_transformer import QwenImageCrossAttention

    return [m.attn for m in tr.modules() if isinstance(m, QwenImageCrossAttention)]


# ----- per instance, by identity, reversible --------------------------------------------------------------------------
def test_swaps_the_impl_of_this_model_only_and_restores_it(fake_npu, bf16_transformer, tiny_pipe):
    from vllm_omni.diffusion.attention.backends.sdpa import SDPAImpl

    fake_npu()
    class_forward = SDPAImpl.__dict__["forward"]
    layers = _layers(bf16_transformer)
    stock = [layer.attention for layer in layers]
    other = [layer.attention for layer in _layers(tiny_pipe.transformer)]
    assert api.select("none,+fused_attention", model=bf16_transformer) == ["fused_attention"]
    assert OPT.report(bf16_transformer) == {"swapped": 2, "skipped": {}, "calls": {}}
    for layer, s in zip(layers, stock, strict=True):
        assert layer.attention is not s and isinstance(layer.attention, SDPAImpl)
        assert type(layer.attention).__name__ == "AscendFusedSDPAImpl"
        assert layer.attention._ascend_opt_stock is s and layer.attention.softmax_scale == s.softmax_scale
    assert [layer.attention for layer in _layers(tiny_pipe.transformer)] == other  # another model: untouched
    assert SDPAImpl.__dict__["forward"] is class_forward  # no class-level patch
    assert OPT.reasons_inactive(bf16_transformer) == []
    api.select("none", model=bf16_transformer)
    assert all(layer.attention is s for layer, s in zip(layers, stock, strict=True))


# ----- what reaches the kernel: BSND, head_num, scale = 1/sqrt(D), mask inverted, no mask when vLLM-Omni dropped it ---
def test_layout_head_num_scale_and_mask_polarity_reach_the_kernel(fake_npu, bf16_transformer, runtime):
    """What reaches the kernel, and its result: equal to SDPA's within tolerance, masked or not."""
    fake = fake_npu()
    tr = bf16_transformer
    refs = {m: run_transformer(tr, runtime, masked=m, seed=1) for m in (True, False)}
    OPT.attach(tr)
    run_transformer(tr, runtime, masked=True)  # first use: verification runs here
    run_transformer(tr, runtime, masked=False)  # ... and the check of the unmasked shape class
    calls, kernel = [], fake.npu_fusion_attention
    fake.npu_fusion_attention = lambda *a, **k: calls.append((a, k)) or kernel(*a, **k)
    got = {m: run_transformer(tr, runtime, masked=m, seed=1) for m in (True, False)}
    report = OPT.report(tr)
    OPT.detach(tr)
    assert len(calls) == 4 and report["calls"] == {"fused": 8}  # 2 blocks x 2 forwards (4 with the first two)
    s = TXT + IMG_HW[0] * IMG_HW[1]
    keep = torch.ones(B, TXT, dtype=torch.bool)
    keep[1, 5:] = False
    joint_keep = torch.cat([keep, torch.ones(B, s - TXT, dtype=torch.bool)], dim=1)
    for i, (args, kwargs) in enumerate(calls):
        q, k, v, head_num = args
        assert q.shape == k.shape == v.shape == (B, s, HEADS, HEAD_DIM) and q.dtype == torch.bfloat16
        assert head_num == HEADS and kwargs["input_layout"] == "BSND"
        assert kwargs["scale"] == pytest.approx(1 / math.sqrt(HEAD_DIM)) and kwargs["scale"] != 1.0
        mask = kwargs["atten_mask"]
        if i < 2:  # masked forward: B1SS bool, True where SDPA's keep-mask is False
            assert mask.dtype == torch.bool and mask.shape == (B, 1, s, s)
            assert torch.equal(mask, (~joint_keep)[:, None, None, :].expand(B, 1, s, s))
            assert mask[1, 0, :, 5:TXT].all() and not mask[0].any()
        else:  # all-true mask dropped upstream (T:1261): no mask at all
            assert mask is None
    for m in (True, False):
        err = (got[m].float() - refs[m].float()).abs().max().item()
        assert 0 < err <= 2.0**-6, err  # a different kernel: close (here 1 bf16 ulp), never wrong
    verdict = OPT.verdicts()[("cpu", "bfloat16")]
    assert verdict.ok and set(verdict.errors) == {"no mask", "padded mask"}
    assert all(e <= fab.ATOL[torch.bfloat16] for e in verdict.errors.values())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fused_forward_matches_fp32_sdpa_with_gqa_and_masks(fake_npu, dtype):
    """The adapter alone, on the real layout, including GQA (Nq/Nkv = 2) and a 4-D bool mask."""
    from vllm_omni.diffusion.attention.backends.abstract import AttentionMetadata

    npu = fake_npu()
    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, 23, 8, 32, generator=g)
    k, v = torch.randn(2, 23, 4, 32, generator=g), torch.randn(2, 23, 4, 32, generator=g)
    keep = torch.ones(2, 23, dtype=torch.bool)
    keep[0, 3:6] = False
    impl = fab.sdpa_impl(8, 32, 32**-0.5, 4)
    for mask in (keep, keep[:, None, None, :]):
        meta = AttentionMetadata(attn_mask=mask)
        ref = impl._forward_impl(q, k, v, meta, mask_mode="full_qk")
        out, why = fab.fused_forward(npu, q.to(dtype), k.to(dtype), v.to(dtype), meta, 32**-0.5)
        assert why == "" and out.dtype == dtype and out.shape == q.shape
        assert (out.float() - ref).abs().max().item() <= fab.ATOL[dtype]


# ----- float32 models stay stock --------------------------------------------------------------------------------------
def test_float32_model_stays_bitwise_stock_with_a_reason(fake_npu, tiny_pipe, runtime):
    fake_npu()
    ref = generate(tiny_pipe, runtime, steps=2, seed=4, cfg_scale=2.0)
    assert api.select("none,+fused_attention", model=tiny_pipe) == ["fused_attention"]
    got = generate(tiny_pipe, runtime, steps=2, seed=4, cfg_scale=2.0)
    reasons = OPT.reasons_inactive(tiny_pipe)
    calls = OPT.report(tiny_pipe)["calls"]
    api.select("none", model=tiny_pipe)
    assert torch.equal(ref.images, got.images)
    assert any("float32" in r for r in reasons) and calls and set(calls) == {"sdpa: dtype float32"}


# ----- documented limits: checked before the call (and the fake would reject the same calls) --------------------------
def _meta(*shape, dtype=torch.bfloat16):
    return torch.empty(shape, dtype=dtype, device="meta")


@pytest.mark.parametrize(
    ("q", "k", "why"),
    [
        ((1, 8, 2, 769), (1, 8, 2, 769), "head dim 769"),
        ((1, 8, 257, 16), (1, 8, 257, 16), "heads 257/257"),
        ((1, 8, 6, 16), (1, 8, 4, 16), "heads 6/4 (Nq 1..256, Nq % Nkv == 0)"),
        ((1, 8, 2, 16, 1), (1, 8, 2, 16, 1), "not BSND"),
        ((1, 5, 2, 16), (1, 5, 2, 16), "causal"),
    ],
)
def test_limits_or_a_causal_impl_send_the_call_to_sdpa(q, k, why, fake_npu):
    """Outside [OP-FA]'s limits, or causal: the swapped impl runs stock SDPA, names why, never calls the kernel."""
    from vllm_omni.diffusion.attention.backends.sdpa import SDPAImpl

    npu = fake_npu()
    qq, kk = torch.zeros(q, dtype=torch.bfloat16), torch.zeros(k, dtype=torch.bfloat16)
    stock = SDPAImpl(num_heads=q[2], head_size=q[3], softmax_scale=0.25, causal=why == "causal", num_kv_heads=k[2])
    stock.forward = lambda *a: "stock"
    impl = fa._make_fused(stock)
    assert impl.forward(qq, kk, kk, None) == "stock"
    (called,) = impl._ascend_opt_calls
    assert called.startswith(f"sdpa: {why}") and impl._ascend_opt_calls[called] == 1
    assert npu.calls["npu_fusion_attention"] == 0
    if why != "causal":
        assert fab.limits_violation(_meta(*q), _meta(*k), _meta(*k)).startswith(why)
    if len(q) == 4 and why != "causal":  # fused_forward checks before calling the kernel, which enforces the same limit
        out, reason = fab.fused_forward(npu, qq, kk, kk, None, None)
        assert out is None and reason.startswith(why)
        with pytest.raises(FakeNpuError, match=r"OP-FA"):
            npu.npu_fusion_attention(qq, kk, kk, q[2], input_layout="BSND")


def test_dtype_and_mask_forms_outside_the_path(fake_npu):
    npu = fake_npu()
    assert fab.limits_violation(_meta(1, 8, 2, 16, dtype=torch.float32), _meta(1, 8, 2, 16), _meta(1, 8, 2, 16)) != ""
    additive = torch.zeros(1, 1, 8, 8)  # a float (additive) mask: SDPA keeps it
    assert fab.kernel_mask(additive, 1, 8, 8)[1].startswith("mask")
    int_keep = torch.tensor([[1, 1, 0, 1]])
    masked, why = fab.kernel_mask(int_keep, 1, 3, 4)
    assert why == "" and masked.shape == (1, 1, 3, 4) and masked[0, 0, :, 2].all() and masked.sum() == 3
    q = torch.zeros(1, 4, 2, 16, dtype=torch.bfloat16)
    with pytest.raises(FakeNpuError, match="atten_mask shape"):  # SDPA's broadcast form is not a kernel form
        npu.npu_fusion_attention(q, q, q, 2, input_layout="BSND", atten_mask=torch.zeros(1, 1, 1, 4, dtype=torch.bool))


def test_graph_mode_goes_to_sdpa(fake_npu, monkeypatch):
    """[OP-FA]: no graph mode. Under NPU graph capture stock runs (counted); while tracing, before any bookkeeping."""
    from vllm_omni.diffusion.attention.backends.sdpa import SDPAImpl

    npu = fake_npu()
    stock = SDPAImpl(num_heads=2, head_size=16, softmax_scale=0.25)
    stock.forward = lambda *a: stock._forward_impl(*a)
    impl = fa._make_fused(stock)
    q = torch.randn(1, 5, 2, 16).bfloat16()
    want = stock._forward_impl(q, q, q, None)
    monkeypatch.setattr(npu._torch_npu_namespace, "is_current_stream_capturing", lambda: True, raising=False)
    assert torch.equal(impl.forward(q, q, q, None), want)
    monkeypatch.setattr(npu._torch_npu_namespace, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    monkeypatch.setattr(OPT, "_forward", lambda *a: pytest.fail("the optimization's forward ran while tracing"))
    assert torch.equal(impl.forward(q, q, q, None), want)
    assert impl._ascend_opt_calls == {"sdpa: graph mode": 1}


# ----- sequence parallelism: after Ulysses' pre-attention; ring and foreign backends are skipped ----------------------
def test_runs_between_the_parallel_strategys_pre_and_post_attention(fake_npu, bf16_transformer, runtime, monkeypatch):
    fake = fake_npu()
    tr = bf16_transformer
    layer = _layers(tr)[0]
    order: list[str] = []

    class Recorder:  # stands for UlyssesParallelAttention: all-to-all before, reverse all-to-all after
        name = "ulysses"

        def pre_attention(self, q, k, v, meta):
            order.append("pre")
            return q, k, v, meta, None

        def post_attention(self, out, ctx):
            order.append("post")
            return out

    monkeypatch.setattr(layer, "_get_active_parallel_strategy", lambda: Recorder())
    OPT.attach(tr)
    run_transformer(tr, runtime, masked=False)  # verification on first use
    kernel = fake.npu_fusion_attention
    fake.npu_fusion_attention = lambda *a, **k: (order.append("kernel"), kernel(*a, **k))[1]
    order.clear()
    run_transformer(tr, runtime, masked=False)
    OPT.detach(tr)
    assert order[:3] == ["pre", "kernel", "post"]


def test_ring_and_non_sdpa_layers_are_skipped(fake_npu, runtime, monkeypatch):
    fake_npu()
    pipe = load_pipeline(runtime, dtype=torch.bfloat16)
    ring_layer, other_layer = _layers(pipe.transformer)
    monkeypatch.setattr(ring_layer, "use_ring", True)
    monkeypatch.setattr(other_layer, "attention", object())
    OPT.attach(pipe)
    report = OPT.report(pipe)
    reasons = OPT.reasons_inactive(pipe)
    OPT.detach(pipe)
    assert report["swapped"] == 0
    assert report["skipped"] == {"ring sequence parallelism": 1, "impl object (not vLLM-Omni's SDPAImpl)": 1}
    assert any("no joint-attention layer takes the fused path" in r for r in reasons)
    assert "ring" in OPT.parallel_support and OPT.parallel_support["ring"].startswith("off")


# ----- op counts per block (through the fake: one kernel = one launch) ------------------------------------------------
def test_op_count_per_block(fake_npu, bf16_transformer, runtime):
    fake_npu()
    tr = bf16_transformer
    block = tr.transformer_blocks[0]

    def count(masked: bool):
        with count_module_calls(block) as res:
            run_transformer(tr, runtime, masked=masked)
        return res[0]

    stock = {m: count(m) for m in (False, True)}
    OPT.attach(tr)
    for m in (True, False):  # verification (first use, and per shape class) happens outside the count
        run_transformer(tr, runtime, masked=m)
    fused = {m: count(m) for m in (False, True)}
    OPT.detach(tr)
    for m in (False, True):
        assert stock[m].counts["aten::_scaled_dot_product_flash_attention_for_cpu"] == 1
        assert fused[m].counts["fake_torch_npu::fusion_attention"] == 1
        assert fused[m].counts["aten::_scaled_dot_product_flash_attention_for_cpu"] == 0
    # No mask: SDPA's one CPU kernel becomes one NPU kernel. Padded mask: invert + materialise B1SS (2 launches)
    # replaces SDPA's bool->float mask conversion (where + 2 scalar_tensor).
    assert fused[False].total == stock[False].total
    assert fused[True].total == stock[True].total - 1


# ----- the NPU check script (benchmarks/npu_check_kernels.py): skips cleanly here, runs end to end against the fake ---
SMALL = ["--fake", "--img-tokens", "24", "--txt-tokens", "40", "--heads", "2", "--head-dim", "16", "--hidden", "32"]
SMALL += ["--iters", "1", "--warmup", "0"]


def test_check_script_skips_without_torch_npu_and_runs_against_the_fake(capsys, tmp_path, monkeypatch):
    """Skips without torch_npu; against the fake: passes, fails a wrong kernel, applies rope's policy and nz's gates."""
    from benchmarks import npu_check_kernels as script

    assert script.main([]) == 0
    out = capsys.readouterr().out
    assert out.startswith("SKIPPED: torch_npu is not installed") and "nothing to check" in out
    js = tmp_path / "check.json"
    assert script.main([*SMALL, "--json", str(js)]) == 0
    out = capsys.readouterr().out
    assert "RESULT: PASS" in out and "plugin: npu_fusion_attention" in out and "plugin: NZ attn.to_qkv" in out
    head = next(ln for ln in out.splitlines() if ln.startswith("npu_check_kernels: "))  # after any import log lines
    assert "| CANN 8.3.RC1 |" in head and "torch_npu 2.13.0+fake" in head
    facts = json.loads(js.read_text())
    assert facts["cann"] == "8.3.RC1" and facts["soc_version"] == 220 and facts["torch_npu"] == "2.13.0+fake"
    assert {k: v["ok"] for k, v in facts["would_use"].items()} == dict.fromkeys(
        ("fused_attention", "nz_weights", "rope"), True
    )
    assert facts["would_use"]["rope"]["tier"] == "pixel" and f"JSON: {js}" in out
    assert script.main([*SMALL, "--json", str(js), "--fake-variant", "fusion_attention=wrong_polarity"]) == 1
    out = capsys.readouterr().out
    assert "RESULT: FAIL" in out and "plugin verification (AttentionPath.first_check)" in out.split("RESULT")[1]
    monkeypatch.setenv(rope_mod.ENV_KERNEL_POLICY, "bitwise")
    assert script.main([*SMALL, "--json", str(js)]) == 1
    out = capsys.readouterr().out
    assert "plugin would use npu_rotary_mul" in out and "RotaryPath.first_check" in out.split("RESULT")[1]
    assert json.loads(js.read_text())["would_use"]["rope"] == {
        "ok": False, "tier": "exact", "policy": "bitwise", "per_shape": {"B*N=2, S=64": False, "B*N=4, S=64": False}
    }  # fmt: skip
    monkeypatch.delenv(rope_mod.ENV_KERNEL_POLICY)
    assert script.main([*SMALL, "--json", str(js), "--fake-cann", "8.2.RC1"]) == 1
    out = capsys.readouterr().out
    assert "CANN 8.2.RC1 < 8.3" in out and not json.loads(js.read_text())["would_use"]["nz_weights"]["ok"]


# ----- the mask once per forward, verification at the shapes that run, the fake's documented semantics ----------------
def test_mask_is_built_once_per_forward_and_other_padding_gets_its_own(fake_npu, bf16_transformer, runtime):
    """One [B,1,S,S] build per forward, not per layer; keyed on shapes, so a new forward must drop it (other padding)."""
    fake = fake_npu()
    tr = bf16_transformer
    pads = (5, None, 3)  # None: no mask

    def run(pad: int | None) -> torch.Tensor:
        return run_transformer(tr, runtime, masked=pad is not None, seed=7, pad=pad or TXT)

    refs = {pad: run(pad) for pad in pads}
    OPT.attach(tr)
    for pad in (5, None):  # verification and the shape-class checks
        run(pad)
    builds, reuses = OPT.stats["mask_builds"], OPT.stats["mask_reuses"]
    calls, kernel, spy, real = [], fake.npu_fusion_attention, [], fab.kernel_mask
    fake.npu_fusion_attention = lambda *a, **k: calls.append(k) or kernel(*a, **k)
    fab.kernel_mask = lambda *a: spy.append(a[0] is not None) or real(*a)
    try:
        got = {pad: run(pad) for pad in pads}
    finally:
        fab.kernel_mask = real
    report, mem = OPT.report(tr), OPT.cache_memory()
    OPT.detach(tr)
    n_layers = len(_layers(tr))
    assert n_layers == 2 and report["calls"]["fused"] >= 2 * n_layers
    assert mem["masks"] == 1 and mem["bytes"] > 0 and mem["check_scratch_peak_bytes"] > 0  # what status reports
    assert sum(spy) == 2  # one build per masked forward, not one per layer
    assert OPT.stats["mask_builds"] - builds == 2 and OPT.stats["mask_reuses"] - reuses == 2 * (n_layers - 1)
    assert any("masks built" in n for n in OPT.notes())
    s = TXT + IMG_HW[0] * IMG_HW[1]
    assert len(calls) == 6
    for kwargs, pad in zip(calls, (5, 5, None, None, 3, 3), strict=True):  # 2 layers per forward
        mask = kwargs["atten_mask"]
        if pad is None:
            assert mask is None
        else:
            assert mask.shape == (B, 1, s, s) and mask[1, 0, :, pad:TXT].all() and not mask[1, 0, :, :pad].any()
    assert not torch.equal(refs[5], refs[3])  # the padding matters (in the tiny model, by less than the tolerance)
    assert not torch.equal(got[5], got[None])
    for pad in pads:
        assert (got[pad].float() - refs[pad].float()).abs().max().item() <= 2.0**-6


def test_shape_check_reference_is_chunked_and_bounded(monkeypatch, fake_npu):
    """At production shapes the fp32 reference never holds more than VERIFY_CHUNK_ELEMS scores at once."""
    fake = fake_npu()
    b, s, n, d = 1, 40, 4, 16
    monkeypatch.setattr(fab, "VERIFY_CHUNK_ELEMS", 2 * s * 8)  # 2 heads x 8 rows x Skv
    seen = []
    real_softmax = torch.softmax
    monkeypatch.setattr(torch, "softmax", lambda x, dim: seen.append(x.numel()) or real_softmax(x, dim=dim))
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, s, n, d, generator=g).bfloat16() for _ in range(3))
    out = fab.call_kernel(fake, q, k, v, None, d**-0.5)
    err, err_stock, finite = fab.class_errors(q, k, v, out, None, d**-0.5)
    assert finite and err <= max(fab.ATOL[torch.bfloat16], 4 * err_stock)
    assert len(seen) > n and max(seen) <= fab.VERIFY_CHUNK_ELEMS and sum(seen) == b * n * s * s


def test_fake_sparse_mode_range_outside_tnd_and_trailing_parameters(fake_npu):
    """[OP-FA] BSND accepts sparse_mode 0..6 only (7, 8: TND); [TNPU-YAML] sink / dropout_mask / seed / offset exist."""
    fake = fake_npu()
    q = torch.randn(1, 8, 2, 16).bfloat16()
    for mode in (7, 8):
        with pytest.raises(FakeNpuError, match=r"0\.\.6"):
            fake.npu_fusion_attention(q, q, q, 2, "BSND", sparse_mode=mode)
    for mode in range(2, 7):  # documented, not modelled by the fake: a NotImplementedError, not a rejection
        with pytest.raises(NotImplementedError):
            fake.npu_fusion_attention(q, q, q, 2, "BSND", sparse_mode=mode)
    fake.npu_fusion_attention(q, q, q, 2, "BSND", sparse_mode=0)
    out = fake.npu_fusion_attention(q, q, q, 2, "BSND", sink=None, dropout_mask=None, seed=0, offset=0)
    assert len(out) == 7
    with pytest.raises(TypeError):
        fake.npu_fusion_attention(q, q, q, 2, "BSND", no_such_argument=1)


def test_fake_rounds_softmax_weights_to_bf16_before_pv(fake_npu):
    """[FA-BF16-P] P is a bf16 operand of the P*V matmul, not one rounding of the fp32 result."""
    fake = fake_npu()
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 64, 2, 32, generator=g).bfloat16() for _ in range(3))
    out = fake.npu_fusion_attention(q, k, v, 2, "BSND", scale=32**-0.5)[0]
    qf, kf, vf = (x.float().transpose(1, 2) for x in (q, k, v))
    p = torch.softmax(qf @ kf.transpose(-1, -2) * 32**-0.5, dim=-1)
    rounded = (p.bfloat16().float() @ vf).transpose(1, 2).bfloat16()
    once = (p @ vf).transpose(1, 2).bfloat16()
    assert torch.equal(out, rounded) and not torch.equal(out, once)
