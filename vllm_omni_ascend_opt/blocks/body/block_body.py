"""The memoized block body: vLLM-Omni's ``QwenImageTransformerBlock.forward`` with its modulation read from unpacked
tensors (:class:`NormMod`, :class:`~.two_segment.SegMod`), and the fast tier's modes of it (:data:`FAST_MODULATE`,
:data:`FAST_RESIDUAL`): each call reported to the mode's owner in eager, the slots followed in a compiled block.
"""

from __future__ import annotations

import sys
from collections import Counter
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import torch
import torch.nn as nn
import torch.nn.functional as F

from vllm_omni_ascend_opt import _backend
from vllm_omni_ascend_opt.blocks.body import direct_calls
from vllm_omni_ascend_opt.blocks.slots import Slot
from vllm_omni_ascend_opt.blocks.upstream import guards, targets
from vllm_omni_ascend_opt.blocks.upstream.ada_norm import NATIVE, NPU_EVAL
from vllm_omni_ascend_opt.blocks.weak_lru import tensor_bytes


class ModeOwner(Protocol):
    """The optimization that turned a fast mode on: told of each call that took the fast path or stock's (and why)."""

    def count_fast(self) -> None: ...
    def count_stock(self, why: str) -> None: ...


FAST_MODULATE: Slot[ModeOwner] = Slot("fast_modulate")
FAST_RESIDUAL: Slot[ModeOwner] = Slot("fast_residual")


def block_calls() -> tuple[ModeOwner | None, ModeOwner | None, Any]:
    """What one block body reads, asked once per block: the owners of :data:`FAST_MODULATE` and
    :data:`FAST_RESIDUAL` when on, and :func:`.direct_calls.decided`; all None while dynamo traces."""
    if guards.tracing():
        return None, None, None
    return FAST_MODULATE.get(), FAST_RESIDUAL.get(), direct_calls.decided()


def use_residual(x: torch.Tensor, gate: torch.Tensor, y: torch.Tensor, owner: ModeOwner | None) -> bool:
    """Whether a gated residual ``x + gate * y`` runs as ``addcmul`` (reported to ``owner``, the
    :data:`FAST_RESIDUAL` mode's, when it is on)."""
    if owner is None:
        return False
    if not (x.dtype == gate.dtype == y.dtype):
        owner.count_stock("mixed dtypes in the gated residual (stock promotes; addcmul would not)")
        return False
    owner.count_fast()
    return True


@dataclass(slots=True)
class NormMod:
    """One AdaLayerNorm's modulation, unpacked: ``first`` is ``1 + scale`` (kinds native/npu_eval) or ``scale``."""

    first: torch.Tensor
    shift: torch.Tensor
    gate: torch.Tensor
    kind: str
    # fast_modulate: the ``[D]`` affine ``(1 + scale, shift)`` of every token, or why not; built on first fast use.
    affine: tuple[torch.Tensor, torch.Tensor] | str | None = None

    def norm(self, norm: nn.Module, x: torch.Tensor, owner: ModeOwner | None, direct: Any = None) -> torch.Tensor:
        """``norm(x, scale, shift)`` with the ops of stock's dispatch (``owner``: the :data:`FAST_MODULATE` mode's
        when it is on, one affine layer norm; ``direct``: :func:`.direct_calls.decided`)."""
        if owner is not None:
            if self.affine is None:
                self.affine = affine_params(self, norm)
            why = self.affine if isinstance(self.affine, str) else _affine_dtype_reason(x, self.affine[0])
            if why is None:
                owner.count_fast()
                return affine_layernorm(self.kind, norm, x, *self.affine)
            owner.count_stock(why)
        if self.kind in (NATIVE, NPU_EVAL):
            return layernorm(self.kind, norm, x, direct) * self.first + self.shift
        return norm(x, self.first, self.shift)

    def residual(self, x: torch.Tensor, y: torch.Tensor, owner: ModeOwner | None) -> torch.Tensor:
        """Stock's ``x + gate * y``; with ``fast_residual`` (``owner``) one ``torch.addcmul(x, gate, y)``."""
        if owner is not None and use_residual(x, self.gate, y, owner):
            return torch.addcmul(x, self.gate, y)
        return x + self.gate * y

    @staticmethod
    def unpack(scale: torch.Tensor, shift: torch.Tensor, gate: torch.Tensor, kind: str) -> NormMod:
        own = torch.contiguous_format
        first = (1 + scale) if kind in (NATIVE, NPU_EVAL) else scale.clone(memory_format=own)
        return NormMod(first, shift.clone(memory_format=own), gate.clone(memory_format=own), kind)

    def nbytes(self) -> int:
        return tensor_bytes((self.first, self.shift, self.gate))


def affine_layernorm(
    kind: str, norm: nn.Module, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor
) -> torch.Tensor:
    """fast_modulate: ``LN(x) * (1 + scale) + shift`` as one affine layer norm (``weight = 1 + scale``, ``bias =
    shift``): one rounding in fp32 opmath instead of stock's three in bf16, close, not exact."""
    if kind == NPU_EVAL:
        return _backend.torch_npu_module().npu_layer_norm_eval(
            x, normalized_shape=[norm.hidden_size], weight=weight, bias=bias, eps=norm.eps
        )
    layer = norm.layernorm
    return F.layer_norm(x, layer.normalized_shape, weight, bias, layer.eps)


def affine_params(mod: NormMod, norm: nn.Module) -> tuple[torch.Tensor, torch.Tensor] | str:
    """``(1 + scale, shift)`` as ``[D]`` views when every token of every sample shares them, else why not."""
    if mod.kind not in (NATIVE, NPU_EVAL):
        return "AdaLayerNorm is not stock's native / torch_npu path (MindIE-SD fused kernel or a patched instance)"
    ln = norm.layernorm
    if ln.weight is not None or ln.bias is not None:
        return "the AdaLayerNorm's LayerNorm has its own affine weights"
    if mod.kind == NATIVE and guards.hooked(ln):
        return "forward hooks on the AdaLayerNorm's LayerNorm"
    first, shift = mod.first, mod.shift
    if first.dim() != 3 or first.shape[1] != 1 or shift.shape != first.shape:
        return "modulation is not one [B, 1, D] row per sample"
    if first.shape[0] > 1 and not (
        torch.equal(first, first[:1].expand_as(first)) and torch.equal(shift, shift[:1].expand_as(shift))
    ):
        return "batch rows have different modulation (per-sample timesteps): one [D] affine cannot serve them"
    return first[0, 0], shift[0, 0]


def _affine_dtype_reason(x: torch.Tensor, weight: torch.Tensor) -> str | None:
    if x.dtype != weight.dtype:
        return "input and modulation dtypes differ (stock promotes; the layer norm's affine would not)"
    if x.shape[-1] != weight.shape[0]:
        return "input width differs from the modulation width"
    return None


def layernorm(kind: str, norm: nn.Module, x: torch.Tensor, direct: Any = None) -> torch.Tensor:
    """The normalisation half of ``AdaLayerNorm`` (kinds native / npu_eval). ``direct`` (eager only:
    :func:`.direct_calls.decided`): a plain inner layer norm is called as its kernel."""
    if kind == NPU_EVAL:
        return _backend.torch_npu_module().npu_layer_norm_eval(x, normalized_shape=[norm.hidden_size], eps=norm.eps)
    ln = norm._modules["layernorm"]
    args = None if direct is None else direct_calls.layer_norm_args(ln, direct)
    return ln(x) if args is None else direct_calls.layer_norm(x, args)


def feed_forward(ff: nn.Module, x: torch.Tensor, stats: Counter | None, direct: Any) -> torch.Tensor:
    """``ff(x)``: its three kernels where :func:`.direct_calls.mlp_args` vouches for them, else the module
    (the reason counted in the caller's ``stats``); the module, uncounted, in a compiled block (``direct`` None)."""
    if direct is None:
        return ff(x)
    args = direct_calls.mlp_args(ff, direct)
    if isinstance(args, str):
        if stats is not None:
            stats["module_calls"] += 1
            stats[f"module call: {args}"] += 1
        return ff(x)
    if stats is not None:
        stats["direct_calls"] += 1
    return direct_calls.mlp(x, args)


def block_body(
    block: nn.Module,
    mods: tuple[Any, ...],
    hidden_states: torch.Tensor,
    encoder_hidden_states: torch.Tensor,
    encoder_hidden_states_mask: torch.Tensor | None,
    image_rotary_emb: tuple[torch.Tensor, torch.Tensor],
    hidden_states_mask: torch.Tensor | None,
    stats: Counter | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The block with its modulation read from ``mods`` (:class:`NormMod`, :class:`~.two_segment.SegMod` or, traced,
    :class:`_Hoisted`): stock's ops on stock's values unless a fast-tier mode is on; ``stats``: the caller's."""
    img1, img2, txt1, txt2 = mods
    m = block._modules
    fm, fr, direct = block_calls()
    img_modulated = img1.norm(m["img_norm1"], hidden_states, fm, direct)
    txt_modulated = txt1.norm(m["txt_norm1"], encoder_hidden_states, fm, direct)
    img_attn_output, txt_attn_output = m["attn"](
        hidden_states=img_modulated,
        encoder_hidden_states=txt_modulated,
        vid_freqs=image_rotary_emb[0],
        txt_freqs=image_rotary_emb[1],
        hidden_states_mask=hidden_states_mask,
        encoder_hidden_states_mask=encoder_hidden_states_mask,
    )
    hidden_states = img1.residual(hidden_states, img_attn_output, fr)
    encoder_hidden_states = txt1.residual(encoder_hidden_states, txt_attn_output, fr)
    img_modulated2 = img2.norm(m["img_norm2"], hidden_states, fm, direct)
    hidden_states = img2.residual(hidden_states, feed_forward(m["img_mlp"], img_modulated2, stats, direct), fr)
    txt_modulated2 = txt2.norm(m["txt_norm2"], encoder_hidden_states, fm, direct)
    txt_ff = feed_forward(m["txt_mlp"], txt_modulated2, stats, direct)
    encoder_hidden_states = txt2.residual(encoder_hidden_states, txt_ff, fr)
    if encoder_hidden_states.dtype == torch.float16:  # stock's clip of fp16 hidden states
        encoder_hidden_states = encoder_hidden_states.clip(-65504, 65504)
    if hidden_states.dtype == torch.float16:
        hidden_states = hidden_states.clip(-65504, 65504)
    return encoder_hidden_states, hidden_states


#: Where a compiled block reads its hoisted modulation (:func:`hoistable`; :mod:`.compiled_blocks`).
READY = "_ascend_ready_modulation"


def hoistable(mods: tuple[Any, ...]) -> tuple[tuple[str, ...], tuple[torch.Tensor, ...]] | None:
    """``mods`` (single-segment only) as the plain ``(kinds, (first, shift, gate) * 4)`` a compiled block reads."""
    if not all(type(m) is NormMod for m in mods):
        return None
    return tuple(m.kind for m in mods), tuple(t for m in mods for t in (m.first, m.shift, m.gate))


class _Hoisted(NamedTuple):
    """One norm's hoisted modulation in a compiled block: fast modes follow their slots (guarded), uncounted."""

    kind: str
    first: torch.Tensor
    shift: torch.Tensor
    gate: torch.Tensor

    def norm(self, norm: nn.Module, x: torch.Tensor, owner: None = None, direct: None = None) -> torch.Tensor:
        kind, first, shift, ln = self.kind, self.first, self.shift, norm.layernorm
        if (
            FAST_MODULATE.get() is not None
            and kind in (NATIVE, NPU_EVAL)
            and first.dim() == 3
            and first.shape[:2] == (1, 1)
            and x.dtype == first.dtype
            and x.shape[-1] == first.shape[-1]
            and ln.weight is None
            and ln.bias is None
        ):
            return affine_layernorm(kind, norm, x, first[0, 0], shift[0, 0])
        if kind in (NATIVE, NPU_EVAL):
            return layernorm(kind, norm, x) * first + shift
        return norm(x, first, shift)

    def residual(self, x: torch.Tensor, y: torch.Tensor, owner: None = None) -> torch.Tensor:
        if FAST_RESIDUAL.get() is not None and x.dtype == self.gate.dtype == y.dtype:
            return torch.addcmul(x, self.gate, y)
        return x + self.gate * y


def traced_block_body(
    block: nn.Module,
    hoisted: tuple[tuple[str, ...], tuple[torch.Tensor, ...]],
    hidden_states: torch.Tensor,
    encoder_hidden_states: torch.Tensor,
    encoder_hidden_states_mask: torch.Tensor | None,
    image_rotary_emb: tuple[torch.Tensor, torch.Tensor],
    hidden_states_mask: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`block_body` for dynamo (single-segment), on the modulation ``hoisted`` in eager; no mutable state read."""
    kinds, t = hoisted
    mods = tuple(_Hoisted(kind, *t[3 * i : 3 * i + 3]) for i, kind in enumerate(kinds))
    streams = (hidden_states, encoder_hidden_states, encoder_hidden_states_mask, image_rotary_emb)
    return block_body(block, mods, *streams, hidden_states_mask)


def block_body_reason(transformer: nn.Module) -> str | None:
    """Why the memoized block body does not run in some blocks (None: it does in all): a vLLM-Omni hook registry
    (MagCache, layerwise offload, SP) captured the stock forward before shared_modulation was installed."""
    patched = sys.modules[targets.TRANSFORMER].QwenImageTransformerBlock.forward
    captured = [b.__dict__.get("_omni_original_forward") for b in transformer.transformer_blocks]
    n = sum(1 for c in captured if c is not None and getattr(c, "__func__", None) is not patched)
    if not n:
        return None
    return (
        f"a vLLM-Omni hook captured the block forward of {n} block(s) before shared_modulation was installed: "
        "they run stock's block with memoized projections"
    )
