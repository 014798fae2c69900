"""Changes made to the model between forwards (a hook, a swapped layer or parameter, a class-level patch, an
attribute set) are seen at the next call: the patched block, attention and modulation memo check the instances per
call. Through the real patched code on the tiny transformer, bitwise against stock."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from tests.harness.forward import build, fwd, inputs, stock_outputs
from vllm_omni_ascend_opt import registry


# ----------------------------------------------------------------------------------------------------------------
# the block body and the joint attention
# ----------------------------------------------------------------------------------------------------------------
@pytest.fixture
def default_tr(runtime):
    tr = build(runtime)
    kw = inputs(torch.float32, txt=32, t=(0.7,))
    (want,) = stock_outputs(tr, runtime, [kw], "default")
    fwd(tr, runtime, kw)  # the memo filled
    return tr, kw, want


def _stats(name):
    opt = registry.get(name)
    opt.reset_stats()
    return opt.stats


def test_attention_hooks_a_swapped_mlp_linear_and_a_patched_adalayernorm_dispatch_are_called(
    runtime, default_tr, monkeypatch
):
    """Hooks on a QK norm (its attention goes to stock) and on an attention, a LoRA-style wrapper swapped in and
    AdaLayerNorm's class-level forward patched (another plugin, MindIE-SD), between forwards: the next forward calls
    them (the norms' kinds decided anew); the output stays stock's."""
    tr, kw, want = default_tr
    fired = []
    h = tr.transformer_blocks[0].attn.norm_added_k.register_forward_hook(lambda *a: fired.append(1))
    ja = _stats("joint_attention")
    assert torch.equal(fwd(tr, runtime, kw), want)
    h.remove()
    assert fired == [1] and ja["joint_calls"] == len(tr.transformer_blocks) - 1
    assert registry.get("joint_attention").fallback_reasons() == {"hooks or an instance forward on a QK norm": 1}
    ja = _stats("joint_attention")
    fwd(tr, runtime, kw)
    assert ja["joint_calls"] == len(tr.transformer_blocks)
    fired.clear()
    h = tr.transformer_blocks[1].attn.register_forward_pre_hook(lambda *a: fired.append(1))
    assert torch.equal(fwd(tr, runtime, kw), want)
    h.remove()
    assert fired == [1]
    fired.clear()
    assert torch.equal(fwd(tr, runtime, kw), want)
    assert fired == []
    ff = tr.transformer_blocks[0].img_mlp

    class Wrapper(nn.Module):
        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, x):
            fired.append(1)
            return self.inner(x)

    stock_out = ff.net[2]
    ff.net[2] = Wrapper(stock_out)
    sm = _stats("shared_modulation")
    assert torch.equal(fwd(tr, runtime, kw), want)
    ff.net[2] = stock_out
    assert fired == [1] and sm["hits"] > 0  # the memoized body ran and called the wrapper
    fired.clear()
    fwd(tr, runtime, kw)
    assert fired == []
    ada = type(tr.transformer_blocks[0].img_norm1)
    stock_forward = ada.forward

    def patched(self, *args, **kwargs):
        fired.append(1)
        return stock_forward(self, *args, **kwargs)

    monkeypatch.setattr(ada, "forward", patched)
    assert torch.equal(fwd(tr, runtime, kw), want)
    assert len(fired) == 4 * len(tr.transformer_blocks)  # every AdaLayerNorm called as a module


# ----------------------------------------------------------------------------------------------------------------
# the modulation memo (block parts, time embedding, norm_out): changes between forwards are seen at the next forward
# ----------------------------------------------------------------------------------------------------------------
#: Where the memo keys (ids for -k): the module a hook goes on, the linear replaced, the reason while hooked.
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


def _new_weight(get):
    def change(tr):
        lin = get(tr)
        old = lin.weight
        lin.weight = nn.Parameter(old.detach() * 0.5, requires_grad=False)
        return lambda: setattr(lin, "weight", old)

    return change


def _layer_norm_eps(tr):
    ln = tr.transformer_blocks[0].img_norm2.layernorm
    eps, ln.eps = ln.eps, 0.5
    return lambda: setattr(ln, "eps", eps)


#: Changes between forwards, each returning its undo: a projection weight, a layer norm's eps, the memo's key weights.
CHANGES = {
    "projection_weight": _new_weight(lambda tr: tr.transformer_blocks[1].attn.to_out),
    "layer_norm_eps": _layer_norm_eps,
    **{f"keyed_anew-{where}": _new_weight(get) for where, (_, get, _) in MEMO_KEYED.items()},
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_a_change_between_forwards_is_used(runtime, default_tr, change):
    """The next forward computes with the model as it is now: the memo never serves what the old weight gave."""
    tr, kw, _ = default_tr
    undo = CHANGES[change](tr)
    got = fwd(tr, runtime, kw)
    (want,) = stock_outputs(tr, runtime, [kw], "default")
    undo()
    assert torch.equal(got, want)


@pytest.mark.parametrize("where", list(MEMO_KEYED))
def test_a_hook_added_between_forwards_runs(runtime, default_tr, where):
    """A hook where the memo keys, added once filled: the memo steps aside (reason reported) until it goes."""
    tr, kw, want = default_tr
    module, _, reason = MEMO_KEYED[where]
    fired = []
    h = module(tr).register_forward_hook(lambda *a: fired.append(1))
    _stats("shared_modulation")
    assert torch.equal(fwd(tr, runtime, kw), want)
    h.remove()
    assert fired == [1]
    assert reason in registry.get("shared_modulation").fallback_reasons()
    sm = _stats("shared_modulation")
    assert torch.equal(fwd(tr, runtime, kw), want)
    assert sm["misses"] == 0 and registry.get("shared_modulation").fallback_reasons() == {}
