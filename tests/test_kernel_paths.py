"""Every verified kernel path behaves alike (``blocks/kernels/verified.py``), through the fake torch_npu: one suite,
parametrised over ``rope``, ``qk_norm`` and ``fused_attention`` on the tiny bf16 transformer: a wrong kernel is refused
with the reason (a new probe or uninstall drops verdicts), a kernel wrong only at long sequences is refused for that
shape class, traced code is stock's; without torch_npu the NPU-only paths stay off and change nothing."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn as nn

from tests.harness.forward import tiny_forward
from tests.harness.stock import stock_then
from vllm_omni_ascend_opt import _backend, api, registry
from vllm_omni_ascend_opt.opts import qk_norm
from vllm_omni_ascend_opt.testbed.pipeline import generate


@dataclass(frozen=True)
class Case:
    spec: str
    kernel: str
    #: the fake_npu keyword of its variants
    fake: str
    #: the optimization's kernel path
    path: Callable[[Any], Any]
    #: calls of one tiny forward that ran stock's (or the portable) code
    stock_calls: Callable[[Any, Any], int]
    #: where a refusal makes it inactive: "" (stays on, its own code), "model" or "process"
    off_where: str = "model"
    #: the optimization's own mutable state (tables, memos, masks, forward generations, per-model calls)
    state: Callable[[Any, Any], Any] = lambda opt, tr: ()


CASES = {
    "rope": Case(
        "none,+rope",
        "npu_rotary_mul",
        "rotary_mul",
        lambda opt: opt.rotary,
        lambda opt, tr: opt.stats["portable_calls"],
        "",
        lambda opt, tr: (len(opt.rotary.tables), len(opt._embed_memo)),
    ),
    "qk_norm": Case(
        "none,+qk_norm", "npu_rms_norm", "rms_norm", lambda opt: opt.path, lambda opt, tr: opt.stats["stock_calls"]
    ),
    "fused_attention": Case(
        "none,+fused_attention",
        "npu_fusion_attention",
        "fusion_attention",
        lambda opt: opt.path,
        lambda opt, tr: opt.report(tr)["calls"]["sdpa: verification failed"],
        "process",
        lambda opt, tr: (len(opt._mask_cache), opt._forward_gen, opt.report(tr)["calls"]),
    ),
}
#: (path, fake variant the first-use or class check refuses, a fragment of its reason, stock calls per tiny forward)
WRONG = [
    ("rope", "half_pairing", "wrong pairing", 8),
    ("qk_norm", "no_gamma", "differs from the fp32", 8),
    ("fused_attention", "wrong_polarity", "padded mask", 2),
    ("fused_attention", "ignores_scale", "tol", 2),
]


@pytest.fixture(params=list(CASES))
def case(request):
    name = request.param
    yield CASES[name], registry.get(name)
    api.select("none")


def _verdicts(path: Any) -> list:
    return path.firsts.values() + path.classes.values()


def _wrong_beyond(fn: Callable[..., Any], seq: int) -> Callable[..., Any]:
    """``fn`` whose output is doubled when its input's sequence (dim 1) is longer than ``seq``."""

    def wrong(x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        out = fn(x, *args, **kwargs)
        if x.shape[1] <= seq:
            return out
        return (out[0] * 2, *out[1:]) if isinstance(out, tuple) else out * 2

    return wrong


@pytest.mark.parametrize(("name", "variant", "fragment", "sites"), WRONG, ids=[f"{w[0]}-{w[1]}" for w in WRONG])
def test_a_wrong_kernel_is_refused_then_a_new_probe_or_uninstall_drops_every_verdict(
    name, variant, fragment, sites, fake_npu, runtime, bf16_transformer, caplog
):
    c, opt, tr = CASES[name], registry.get(name), bf16_transformer
    npu = fake_npu(**{c.fake: variant})
    ref = stock_then(c.spec, tr, lambda: tiny_forward(runtime, tr))
    with caplog.at_level(logging.WARNING, logger="vllm_omni_ascend_opt"):
        assert torch.equal(tiny_forward(runtime, tr), ref)  # stock's (or the portable) code ran, bitwise
    path = c.path(opt)
    refused = _verdicts(path)
    assert refused and not any(v.ok for v in refused) and all(fragment in v.reason for v in refused)
    assert all(s in caplog.text for s in ("refused", c.kernel, fragment, refused[0].place))
    assert opt.stats["kernel_calls"] == 0 and c.stock_calls(opt, tr) == sites
    assert any("refused" in n and fragment in n for n in opt.notes())
    reasons = opt.reasons_inactive(tr if c.off_where == "model" else None)
    assert any(c.kernel in r and "refused" in r and fragment in r for r in reasons) if c.off_where else reasons == []
    tried = npu.calls[c.kernel]
    assert tried > 0 and (name == "fused_attention" or opt.tier() == "exact")
    tiny_forward(runtime, tr)
    assert npu.calls[c.kernel] == tried  # a refused kernel is not called again under this probe
    npu = fake_npu()  # another torch_npu: a new probe
    assert _verdicts(path) == []
    tiny_forward(runtime, tr)
    assert _verdicts(path) and all(v.ok for v in _verdicts(path))
    checked = npu.calls[c.kernel]
    tiny_forward(runtime, tr)
    assert npu.calls[c.kernel] > checked  # used, warm
    probe = _backend.probe_id()
    api.select("none", model=tr)  # uninstall drops every verdict too (same probe): a re-install checks afresh
    assert _backend.probe_id() == probe and _verdicts(path) == []


def test_the_shape_class_check_refuses_a_kernel_wrong_only_at_long_sequences(
    case, fake_npu, runtime, bf16_transformer, caplog
):
    c, opt = case
    tr = bf16_transformer
    npu = fake_npu()
    setattr(npu, c.kernel, _wrong_beyond(getattr(npu, c.kernel), 64))
    api.select(c.spec, model=tr)
    path = c.path(opt)
    with caplog.at_level(logging.WARNING, logger="vllm_omni_ascend_opt"):
        for hw in ((10, 10), (4, 4)):  # 100 image tokens (107 joint), then 16 (23 joint); 7 text tokens
            tiny_forward(runtime, tr, hw=hw)
    assert all(v.ok for v in path.firsts.values())  # the first-use check cannot see it
    classes = path.classes.values()
    refused = [v for v in classes if not v.ok]
    assert len(refused) == 1 and len(classes) >= 2, [v.describe() for v in classes]
    assert refused[0].place in caplog.text and "refused" in caplog.text
    tally = opt.kernel_classes()
    assert tally["kernel"] == len(classes) - 1 and tally["stock"] == 1
    assert list(tally["why"]) == ["refused: " + refused[0].reason.split(";")[0]]
    checks, calls = opt.stats["shape_checks"], npu.calls[c.kernel]
    assert checks == len(classes)
    for hw in ((10, 10), (4, 4)):
        tiny_forward(runtime, tr, hw=hw)
    assert opt.stats["shape_checks"] == checks and npu.calls[c.kernel] > calls  # checked once, the rest kept


def test_traced_code_is_stock_and_counts_nothing(case, fake_npu, runtime, bf16_transformer, caplog, monkeypatch):
    """Under torch.compile (the embedder, a block's attention, a whole forward) the graph holds stock code."""
    c, opt = case
    npu = fake_npu()
    tr = bf16_transformer
    attn = tr.transformer_blocks[0].attn
    g = torch.Generator().manual_seed(0)
    hs = torch.randn(1, 16, attn.dim, generator=g).bfloat16()
    ehs = torch.randn(1, 7, attn.dim, generator=g).bfloat16()
    cpu = torch.device("cpu")
    api.select("none", model=tr)
    with runtime.context(), torch.no_grad():
        vid, txt = tr.pos_embed([(1, 4, 4)], [7], device=cpu)
        want = attn(hs, ehs, vid, txt)
    with monkeypatch.context() as m:
        m.setattr(torch.compiler, "is_compiling", lambda: True)  # a whole (padded) forward as dynamo traces it
        full = tiny_forward(runtime, tr, batch=2, pad=True)
    api.select(c.spec, model=tr)
    opt.reset_stats()
    state = c.state(opt, tr)
    caplog.clear()
    torch._dynamo.reset()
    try:
        with runtime.context(), torch.no_grad(), caplog.at_level(logging.DEBUG, logger="vllm_omni_ascend_opt"):
            emb = torch.compile(tr.pos_embed, backend="eager", fullgraph=True)([(1, 4, 4)], [7], cpu)
            got = torch.compile(attn, backend="eager", fullgraph=True)(hs, ehs, vid, txt)
            with monkeypatch.context() as m:
                m.setattr(torch.compiler, "is_compiling", lambda: True)
                assert torch.equal(tiny_forward(runtime, tr, batch=2, pad=True), full)
    finally:
        torch._dynamo.reset()
    assert torch.equal(emb[0], vid) and torch.equal(emb[1], txt)
    assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))
    assert npu.calls[c.kernel] == 0 and not opt.stats and _verdicts(c.path(opt)) == []
    assert opt.fallback_reasons() == {} and c.state(opt, tr) == state
    assert not caplog.records
    with runtime.context(), torch.no_grad():
        attn(hs, ehs, vid, txt)  # eager again: the path acts (it was in place while tracing)
    assert npu.calls[c.kernel] > 0 and opt.stats


NO_NPU = [("fused_attention", {"swapped": 0}, "close"), ("nz_weights", {"cast": []}, "close"), ("qk_norm", {}, "exact")]


@pytest.mark.parametrize(("name", "nothing", "tier"), NO_NPU)
def test_without_torch_npu_inactive_with_the_reason_and_nothing_changes(name, nothing, tier, tiny_pipe, runtime):
    """Not installed (not by ``default`` either), says why; a direct attach leaves impls, weights and images stock's."""
    opt, tr = registry.get(name), tiny_pipe.transformer

    def state():  # the weights' storage and the attention impls
        impls = [type(b.attn.attn.attention) for b in tr.transformer_blocks]
        return {n: p.data_ptr() for n, p in tr.named_parameters()}, impls

    assert any("torch_npu is not installed" in r for r in opt.reasons_inactive())
    before = state()
    ref = generate(tiny_pipe, runtime, steps=2, seed=3)
    assert api.select(f"none,+{name}", model=tiny_pipe) == []
    opt.attach(tiny_pipe)
    assert any("torch_npu" in r for r in opt.reasons_inactive(tiny_pipe))
    assert {k: opt.report(tiny_pipe)[k] for k in nothing} == nothing and state() == before
    got = generate(tiny_pipe, runtime, steps=2, seed=3)
    opt.detach(tiny_pipe)
    assert state() == before and torch.equal(ref.images, got.images)
    api.select("default", model=tiny_pipe)
    assert name in registry.default_names() and not opt.installed and name not in api.installed()
    assert all(type(n) is nn.RMSNorm for n in qk_norm._qk_norms(tiny_pipe))
    row = {r["name"]: r for r in api.status()}[name]
    assert row["tier"] == tier and row["equivalence"] == opt.equivalence and not row["active"]
    assert any("torch_npu is not installed" in r for r in row["reasons_inactive"])
