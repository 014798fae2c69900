"""Plans kept per module instance (``blocks/stamps.py``): an answer is reused while what its check read is unchanged,
and remade at the next call after any change between forwards (a hook, a swapped layer or parameter, a class or an
attribute set). Through the real patched block and attention on the tiny transformer, bitwise against stock."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from vllm_omni_ascend_opt import api, registry
from vllm_omni_ascend_opt.blocks import block_body
from vllm_omni_ascend_opt.blocks.stamps import PlanCache, Stamp


def _build(runtime):
    from vllm_omni_ascend_opt.testbed import blockops

    return blockops.build_transformer(runtime, blockops.TINY, torch.float32)


def _fwd(runtime, tr, kw):
    from vllm_omni_ascend_opt.testbed import blockops  # noqa: F401  (the runtime's modules are imported)

    with runtime.context(), torch.no_grad():
        return tr(**kw)[0].detach().clone()


def _inputs(tr):
    from vllm_omni_ascend_opt.testbed import blockops

    return blockops.t2i_inputs(tr, torch.float32, 32, 32)


# ----------------------------------------------------------------------------------------------------------------
# the stamp itself
# ----------------------------------------------------------------------------------------------------------------
def test_stamp_breaks_on_every_recorded_kind_of_change():
    lin = nn.Linear(4, 4)

    def stamp() -> Stamp:
        s = Stamp()
        assert s.module(lin)
        s.read(lin._parameters, "weight")
        s.read(lin._parameters, "bias")
        s.attr(lin, "in_features")
        s.attr(lin, "training_only_on_class") if hasattr(lin, "training_only_on_class") else None
        assert s.holds()
        return s

    s = stamp()
    h = lin.register_forward_hook(lambda *a: None)
    assert not s.holds()
    h.remove()
    assert s.holds()
    s = stamp()
    lin.forward = lin.forward  # an instance forward
    assert not s.holds()
    del lin.forward
    s = stamp()
    lin.weight = nn.Parameter(lin.weight.detach().clone())
    assert not s.holds()
    s = stamp()
    lin.in_features = 5
    assert not s.holds()
    s = stamp()

    class Sub(nn.Linear):
        pass

    lin.__class__ = Sub
    assert not s.holds()


def test_stamp_sees_a_missing_key_appear():
    m = nn.Module()
    s = Stamp()
    assert s.read(m._modules, "extra") is None
    assert s.holds()
    m.extra = nn.Identity()
    assert not s.holds()


def test_plan_cache_reuses_while_the_stamp_holds_and_forgets_dead_modules():
    cache = PlanCache()
    held = [nn.Linear(2, 2)]
    made = []

    def make(s: Stamp):
        s.module(held[0])
        made.append(1)
        return len(made)

    lin = held[0]
    assert cache.get(lin, make) == 1 and cache.get(lin, make) == 1
    h = lin.register_forward_pre_hook(lambda *a: None)
    assert cache.get(lin, make) == 2
    h.remove()
    assert cache.get(lin, make) == 3 and len(cache) == 1
    del lin, h
    held.clear()
    assert len(cache) == 0


# ----------------------------------------------------------------------------------------------------------------
# through the patched block and attention: changes between forwards are seen at the next call
# ----------------------------------------------------------------------------------------------------------------
@pytest.fixture
def default_tr(runtime):
    tr = _build(runtime)
    kw = _inputs(tr)
    api.select("none", model=tr)
    want = _fwd(runtime, tr, kw)
    api.select("default", model=tr)
    _fwd(runtime, tr, kw)  # plans made
    return tr, kw, want


def _stats(name):
    opt = registry.get(name)
    opt.reset_stats()
    return opt.stats


def test_plans_are_kept_across_forwards(runtime, default_tr):
    tr, kw, want = default_tr
    keys = [id(b) for b in tr.transformer_blocks]

    def plans():
        return [id(block_body.PLANS._plans[k][2]) for k in keys]

    made = plans()
    assert torch.equal(_fwd(runtime, tr, kw), want)
    assert plans() == made  # the same plan objects: not remade


def test_a_swapped_mlp_linear_is_called_as_the_new_module(runtime, default_tr):
    """A LoRA-style wrapper put in place of a layer between forwards: the next forward calls the wrapper."""
    tr, kw, want = default_tr
    ff = tr.transformer_blocks[0].img_mlp
    calls = []

    class Wrapper(nn.Module):
        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, x):
            calls.append(1)
            return self.inner(x)

    stock_out = ff.net[2]
    ff.net[2] = Wrapper(stock_out)
    sm = _stats("shared_modulation")
    try:
        assert torch.equal(_fwd(runtime, tr, kw), want)
    finally:
        ff.net[2] = stock_out
    assert calls == [1] and sm["module_calls"] == 1
    calls.clear()
    sm = _stats("shared_modulation")
    _fwd(runtime, tr, kw)
    assert calls == [] and sm["module_calls"] == 0 and sm["direct_calls"] == 2 * len(tr.transformer_blocks)


def test_a_replaced_projection_weight_is_used(runtime, default_tr):
    """A parameter replaced between forwards (not written in place): the direct call uses the new one."""
    tr, kw, _ = default_tr
    attn = tr.transformer_blocks[1].attn
    old = attn.to_out.weight
    attn.to_out.weight = nn.Parameter(old.detach() * 0.5, requires_grad=False)
    try:
        got = _fwd(runtime, tr, kw)
        api.select("none", model=tr)
        want = _fwd(runtime, tr, kw)
    finally:
        attn.to_out.weight = old
    assert torch.equal(got, want)


def test_a_changed_layer_norm_eps_is_used(runtime, default_tr):
    tr, kw, _ = default_tr
    ln = tr.transformer_blocks[0].img_norm2.layernorm
    eps = ln.eps
    ln.eps = 0.5
    try:
        got = _fwd(runtime, tr, kw)
        api.select("none", model=tr)
        want = _fwd(runtime, tr, kw)
    finally:
        ln.eps = eps
    assert torch.equal(got, want)


def test_a_qk_norm_hook_added_between_forwards_sends_the_attention_to_stock(runtime, default_tr):
    tr, kw, want = default_tr
    fired = []
    h = tr.transformer_blocks[0].attn.norm_added_k.register_forward_hook(lambda *a: fired.append(1))
    ja = _stats("joint_attention")
    try:
        assert torch.equal(_fwd(runtime, tr, kw), want)
    finally:
        h.remove()
    assert fired == [1] and ja["joint_calls"] == len(tr.transformer_blocks) - 1
    assert registry.get("joint_attention").fallback_reasons() == {"hooks or an instance forward on a QK norm": 1}
    ja = _stats("joint_attention")
    _fwd(runtime, tr, kw)
    assert ja["joint_calls"] == len(tr.transformer_blocks)


def test_plans_do_not_keep_a_dropped_model_alive(runtime):
    """A plan is kept for a module, never keeps it: drop the model and its blocks' plans go with it."""
    import gc
    import weakref

    tr = _build(runtime)
    kw = _inputs(tr)
    api.select("default", model=tr)
    _fwd(runtime, tr, kw)
    blocks = [weakref.ref(b) for b in tr.transformer_blocks]
    attns = [weakref.ref(b.attn) for b in tr.transformer_blocks]
    keys = {id(b) for b in tr.transformer_blocks}
    assert keys <= set(block_body.PLANS._plans)
    n = len(block_body.PLANS)
    del tr  # still installed: only the plans' own references could keep it
    gc.collect()
    assert all(r() is None for r in blocks + attns)
    assert not keys & set(block_body.PLANS._plans)
    assert len(block_body.PLANS) == n - len(keys)


def test_uninstall_drops_the_block_plans(runtime, default_tr):
    """Like every cache of the plugin, the block plans go on uninstall (the next install makes them anew)."""
    tr, kw, want = default_tr
    assert id(tr.transformer_blocks[0]) in block_body.PLANS._plans
    memo = registry.get("shared_modulation").memo
    assert len(memo.plans.parts) == len(tr.transformer_blocks) and len(memo.plans.time) == 1
    api.select("none", model=tr)
    assert len(block_body.PLANS) == 0
    assert len(memo.plans) == 0
    api.select("default", model=tr)
    assert torch.equal(_fwd(runtime, tr, kw), want)


# ----------------------------------------------------------------------------------------------------------------
# the memo's plans (block parts, time embedding): changes between forwards are seen at the next forward
# ----------------------------------------------------------------------------------------------------------------
def _stock_after(runtime, tr, kw, spec="default"):
    """Stock's output for the model as it is now, then back to ``spec``."""
    api.select("none", model=tr)
    want = _fwd(runtime, tr, kw)
    api.select(spec, model=tr)
    return want


def test_memo_block_plans_are_kept_across_forwards(runtime, default_tr):
    tr, kw, want = default_tr
    memo = registry.get("shared_modulation").memo
    keys = [id(b) for b in tr.transformer_blocks]
    made = [id(memo.plans.parts._plans[k][2]) for k in keys]
    assert torch.equal(_fwd(runtime, tr, kw), want)
    assert [id(memo.plans.parts._plans[k][2]) for k in keys] == made


#: What the memo keys, by where it sits (the ids the mutation check selects with -k): the module a hook goes on, the
#: linear whose weight is replaced, the fallback reason while the hook is there.
MEMO_KEYED = {
    "modulation": (
        lambda tr: tr.transformer_blocks[0].txt_mod,
        lambda tr: tr.transformer_blocks[1].img_mod[1],
        "forward hooks on a modulation module (skipping it would skip the hook)",
    ),
    "time_embedding": (
        lambda tr: tr.time_text_embed.timestep_embedder.linear_2,
        lambda tr: tr.time_text_embed.timestep_embedder.linear_1,
        "hooks or an instance forward in time_text_embed",
    ),
    "norm_out": (
        lambda tr: tr.norm_out.linear,
        lambda tr: tr.norm_out.linear,
        "norm_out's SiLU/linear is not stock's (or has hooks)",
    ),
}


@pytest.mark.parametrize("where", list(MEMO_KEYED))
def test_a_replaced_weight_is_keyed_anew(runtime, default_tr, where):
    """A weight the memo keys on, replaced between forwards (a new Parameter, same shape): the memo must not serve
    what the old weight gave."""
    tr, kw, _ = default_tr
    lin = MEMO_KEYED[where][1](tr)
    old = lin.weight
    lin.weight = nn.Parameter(old.detach() * 0.5, requires_grad=False)
    try:
        got = _fwd(runtime, tr, kw)
        want = _stock_after(runtime, tr, kw)
    finally:
        lin.weight = old
    assert torch.equal(got, want)


@pytest.mark.parametrize("where", list(MEMO_KEYED))
def test_a_hook_added_between_forwards_runs(runtime, default_tr, where):
    """A forward hook on what the memo keys on, put there after its plan was made: the memo steps aside at the next
    forward (the hook runs, the reason is reported), and serves again once the hook is gone."""
    tr, kw, want = default_tr
    module, _, reason = MEMO_KEYED[where]
    fired = []
    h = module(tr).register_forward_hook(lambda *a: fired.append(1))
    _stats("shared_modulation")
    try:
        assert torch.equal(_fwd(runtime, tr, kw), want)
    finally:
        h.remove()
    assert fired == [1]
    assert reason in registry.get("shared_modulation").fallback_reasons()
    sm = _stats("shared_modulation")
    assert torch.equal(_fwd(runtime, tr, kw), want)
    assert sm["misses"] == 0 and registry.get("shared_modulation").fallback_reasons() == {}


def test_a_patched_adalayernorm_dispatch_is_seen_by_the_memo_plans(runtime, default_tr, monkeypatch):
    """AdaLayerNorm's class-level forward patched between forwards (another plugin, a MindIE-SD port): the norms'
    kinds are decided anew, so the patched forward is the one that runs."""
    tr, kw, want = default_tr
    ada = type(tr.transformer_blocks[0].img_norm1)
    calls = []
    stock_forward = ada.forward

    def patched(self, *args, **kwargs):
        calls.append(1)
        return stock_forward(self, *args, **kwargs)

    monkeypatch.setattr(ada, "forward", patched)
    assert torch.equal(_fwd(runtime, tr, kw), want)
    assert len(calls) == 4 * len(tr.transformer_blocks)  # every AdaLayerNorm called as a module


def test_an_attention_hook_added_between_forwards_runs(runtime, default_tr):
    """The block body calls a plain attention's forward without the module call: a hook put on the attention after
    the block's plan was made must make it a module call again (the hook runs), and the output stays stock's."""
    tr, kw, want = default_tr
    block = tr.transformer_blocks[1]

    def direct() -> bool:  # what the block's plan decided in the last forward: forward called without __call__
        return block_body.PLANS._plans[id(block)][2].attn_plain

    assert direct()  # the plain attention took the direct call
    fired = []
    h = block.attn.register_forward_pre_hook(lambda *a: fired.append(1))
    try:
        assert torch.equal(_fwd(runtime, tr, kw), want)
        assert not direct()
    finally:
        h.remove()
    assert fired == [1]
    fired.clear()
    assert torch.equal(_fwd(runtime, tr, kw), want)
    assert fired == [] and direct()
