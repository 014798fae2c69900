"""The joint QKV path's building blocks: the joint RMSNorm, the joint freqs cache, the checks, the attention on the
joint sequence, and :func:`traced_forward`: ``joint_attention``'s eager math for a graph, without counters or caches.
"""

from __future__ import annotations

import functools
import sys
from collections import Counter
from typing import Any

import torch
import torch.nn as nn

from vllm_omni_ascend_opt.blocks.body import compiled_blocks
from vllm_omni_ascend_opt.blocks.kernels import rms_norm, rope_tables
from vllm_omni_ascend_opt.blocks.upstream import guards
from vllm_omni_ascend_opt.blocks.upstream import targets as _targets
from vllm_omni_ascend_opt.blocks.weak_lru import WeakLRU, tensor_bytes

#: Where a compiled block's attention holds this forward's joint ``(cos, sin_signed)`` tables.
READY_ROPE = "_ascend_ready_rope"
#: Joint freqs kept (LRU): one per (vid, txt) freqs pair.
JOINT_FREQS_CACHE_SIZE = 16
_OPMATH = {torch.float16: torch.float32, torch.bfloat16: torch.float32}
#: Devices where ``torch.rms_norm(x_opmath, (D,), None, eps)`` runs the composite's pieces (NPU: torch_npu registers no
#: rms_norm kernel; CPU: checked bitwise in tests/test_joint_attention.py).
COMPOSITE_RMS_DEVICES = frozenset({"cpu", "npu"})


def joint_rms_norm(x: torch.Tensor, st: int, w_txt: torch.Tensor, w_img: torch.Tensor, eps: float) -> torch.Tensor:
    """``cat([rms_norm(x[:, :st], w_txt), rms_norm(x[:, st:], w_img)], dim=1)``, bitwise, with one norm pass: torch's
    ``rms_norm`` composite (upcast to opmath, ``x * rsqrt(mean(x^2) + eps)``, ``* weight`` promoted, one cast back)."""
    dtype = x.dtype
    opmath = _OPMATH.get(dtype, dtype)
    normed = _rms_rows(x.to(opmath), eps, opmath)
    out_dtype = _promote(normed.dtype, w_txt.dtype)
    if out_dtype != _promote(normed.dtype, w_img.dtype):
        raise ValueError("the two norm weights promote to different dtypes")
    out = torch.empty(normed.shape, dtype=out_dtype, device=normed.device)
    torch.mul(normed[:, :st], w_txt, out=out[:, :st])
    torch.mul(normed[:, st:], w_img, out=out[:, st:])
    return out.to(dtype)


def joint_qk_rms_norm(
    qk: torch.Tensor,
    st: int,
    w_txt: tuple[torch.Tensor, torch.Tensor],
    w_img: tuple[torch.Tensor, torch.Tensor],
    eps: float,
) -> torch.Tensor:
    """:func:`joint_rms_norm` of the ``[2, B, S, N, D]`` q/k view (``w_txt``/``w_img``: each stream's (q, k) weights)
    as a new tensor, bitwise stock's four norms; upcast one plane at a time (both at once: a peak above stock's)."""
    dtype = qk.dtype
    opmath = _OPMATH.get(dtype, dtype)
    if dtype == opmath:
        normed = _rms_rows(qk, eps, opmath).contiguous()  # already is (the input view is not dense)
        for i in (0, 1):
            normed[i, :, :st].mul_(w_txt[i])
            normed[i, :, st:].mul_(w_img[i])
        return normed
    out = torch.empty(qk.shape, dtype=dtype, device=qk.device)
    for i in (0, 1):
        normed = _rms_rows(qk[i].to(opmath), eps, opmath)
        normed[:, :st].mul_(w_txt[i])
        normed[:, st:].mul_(w_img[i])
        out[i].copy_(normed)
        del normed
    return out


def _rms_rows(xu: torch.Tensor, eps: float, opmath: torch.dtype) -> torch.Tensor:
    """``x * rsqrt(mean(x^2) + eps)`` per row of an opmath tensor, as torch 2.13's ``rms_norm`` composite does it."""
    if xu.device.type in COMPOSITE_RMS_DEVICES:
        return torch.rms_norm(xu, (xu.shape[-1],), None, eps)
    return xu.mul(torch.rsqrt(xu.pow(2).mean(-1, keepdim=True).add_(_opmath_scalar(eps, opmath))))


def qk_weights_fit(dtype: torch.dtype, weights: tuple[torch.Tensor, ...]) -> bool:
    """Whether :func:`joint_qk_rms_norm` can multiply by ``weights`` in place (each promotes to the opmath type)."""
    opmath = _OPMATH.get(dtype, dtype)
    for w in weights:
        if _promote(opmath, w.dtype) != opmath:
            return False
    return True


@functools.lru_cache(maxsize=64)
def _promote(a: torch.dtype, b: torch.dtype) -> torch.dtype:
    """``torch.promote_types`` memoized (it dispatches an aten op: kept off the counted hot path)."""
    return torch.promote_types(a, b)


@functools.lru_cache(maxsize=64)
def _opmath_scalar(eps: float, opmath: torch.dtype) -> float:
    """``eps`` rounded to the opmath type, as the composite's ``add_(eps)`` applies it."""
    return float(torch.tensor(eps, dtype=opmath))


def _plain_rms_norm(norm: nn.Module) -> str | None:
    """Why ``norm`` cannot take part in the joint norm (None when it can)."""
    if type(norm) not in rms_norm.RMS_NORM_CLASSES:
        return f"QK norm is {type(norm).__name__}, not nn.RMSNorm (qk_norm=False or another norm)"
    if "forward" in norm.__dict__ or norm._forward_hooks or norm._forward_pre_hooks:
        return "hooks or an instance forward on a QK norm"
    if norm._parameters.get("weight") is None:
        return "QK norm without weight (elementwise_affine=False)"
    if norm.eps is None:
        return "QK norm with eps=None (dtype-dependent eps)"
    return None


def static_reason(attn: nn.Module) -> str | None:
    """Why the joint path cannot run for this ``QwenImageCrossAttention`` (its modules, global hooks), or None."""
    m = attn._modules
    norms = (m["norm_q"], m["norm_k"], m["norm_added_q"], m["norm_added_k"])
    d = (attn.head_dim,)
    for n in norms:
        why = _plain_rms_norm(n)
        if why:
            return why
        if n.normalized_shape != d:
            return "a QK norm does not normalize over head_dim"
    if norms[0].eps != norms[2].eps or norms[1].eps != norms[3].eps:
        return "the text and image QK norms use different eps"
    if attn.query_num_heads != attn.add_query_num_heads or attn.kv_num_heads != attn.add_kv_num_heads:
        return "text and image projections have different head counts"
    if guards.global_hooks():
        return "global module hooks are registered"
    if not rope_tables.native_equivalent(m["rope"]):
        return "stock RoPE runs a device kernel (MindIE-SD/CUDA), not vLLM-Omni's native rotary math"
    return None


def freqs_ok(freqs: torch.Tensor, seq: int, head_dim: int) -> bool:
    return freqs.dim() == 2 and freqs.is_complex() and freqs.shape[0] == seq and freqs.shape[-1] * 2 <= head_dim


class JointFreqsCache(WeakLRU[torch.Tensor]):
    """``cat(txt_freqs, vid_freqs)`` per (vid, txt) freqs pair, keyed like ``rope``'s tables, dropped with either."""

    def __init__(self, stats: Counter) -> None:
        super().__init__(JOINT_FREQS_CACHE_SIZE)
        self._stats = stats

    def nbytes(self) -> int:
        return tensor_bytes(list(self.values()))

    def joint(self, vid: torch.Tensor, txt: torch.Tensor) -> torch.Tensor:
        kv, rv = rope_tables.table_key(vid, vid.dtype)
        kt, rt = rope_tables.table_key(txt, txt.dtype)
        key, owners = (kv, kt), (rv, rt)
        hit = self.get(key, owners)
        if hit is not None:
            self._stats["joint_freqs_hits"] += 1
            return hit
        self._stats["joint_freqs_builds"] += 1
        return self.put(key, owners, torch.cat([txt, vid], dim=0))


def graph_joint_rms_norm(
    x: torch.Tensor, st: int, w_txt: torch.Tensor, w_img: torch.Tensor, eps: float
) -> torch.Tensor:
    """:func:`joint_rms_norm` for a compiled graph: the same values, one ``cat`` instead of ``out=`` writes."""
    dtype = x.dtype
    normed = torch.rms_norm(x.to(_OPMATH.get(dtype, dtype)), (x.shape[-1],), None, eps)
    return torch.cat([normed[:, :st] * w_txt, normed[:, st:] * w_img], dim=1).to(dtype)


def any_cuda_fused(
    attn: nn.Module, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor, vid_freqs: Any, txt_freqs: Any
) -> bool:
    """Stock's ``_qwen_image_qk_norm_rope`` takes its fused CUDA path for either stream of this attention (the image
    stream's only with ``qk_norm``; ``_fused_cuda_supported`` reads only q/k's device and dtype, the stream's)."""
    mod = sys.modules[_targets.TRANSFORMER]
    for x, freqs, on in ((hidden_states, vid_freqs, attn.qk_norm), (encoder_hidden_states, txt_freqs, True)):
        if (
            on
            and x.shape[0] * x.shape[1] >= mod.fused_qk_norm_rope_min_tokens(mod._FUSED_MIN_TOKENS)
            and mod._fused_cuda_supported(x, x, attn.head_dim, freqs.shape[-1] * 2, interleaved=True)
        ):
            return True
    return False


def shape_reason(
    attn: nn.Module, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor, vid_freqs: Any, txt_freqs: Any
) -> str | None:
    """Why the joint path does not fit these inputs (shapes, dtypes, freqs), or None."""
    if hidden_states.dim() != 3 or encoder_hidden_states.dim() != 3:
        return "hidden states are not [B, S, D]"
    if hidden_states.dtype != encoder_hidden_states.dtype:
        return "text and image hidden states differ in dtype"
    d = attn.head_dim
    if not isinstance(vid_freqs, torch.Tensor) or not isinstance(txt_freqs, torch.Tensor):
        return "freqs are not tensors"
    if not freqs_ok(vid_freqs, hidden_states.shape[1], d) or not freqs_ok(txt_freqs, encoder_hidden_states.shape[1], d):
        return "RoPE freqs do not match the sequence lengths (complex [S, D/2] expected)"
    if vid_freqs.shape[-1] != txt_freqs.shape[-1] or vid_freqs.device != txt_freqs.device:
        return "text and image freqs differ in rotary dim or device"
    return None


def attend(
    mod: Any,
    attn: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    st: int,
    hidden_states: torch.Tensor,
    encoder_hidden_states: torch.Tensor,
    hidden_states_mask: torch.Tensor | None,
    encoder_hidden_states_mask: torch.Tensor | None,
    stats: Counter | None = None,
) -> torch.Tensor:
    """Stock's attention on the joint ``[B, S_txt + S_img, N, D]`` q/k/v (under SP the text rows as the joint part,
    else with stock's padded-text key mask), flattened to ``[B, S, N*D]`` in q's dtype. ``stats``: eager only."""
    m = attn._modules
    pc = attn.parallel_config
    if pc is not None and pc.sequence_parallel_size > 1 and not mod.get_forward_context().split_text_embed_in_sp:
        attn_metadata = mod.AttentionMetadata(
            joint_query=query[:, :st], joint_key=key[:, :st], joint_value=value[:, :st], joint_strategy="front"
        )
        if hidden_states_mask is not None:
            attn_metadata.attn_mask = hidden_states_mask
        if encoder_hidden_states_mask is not None:
            attn_metadata.joint_attn_mask = encoder_hidden_states_mask
        if stats is not None:
            stats["sp_calls"] += 1
        joint_hidden_states = m["attn"](query[:, st:], key[:, st:], value[:, st:], attn_metadata)
    else:
        attn_metadata = None
        if hidden_states_mask is not None or encoder_hidden_states_mask is not None:
            txt_mask = _keep_all_if_none(encoder_hidden_states_mask, encoder_hidden_states)
            img_mask = _keep_all_if_none(hidden_states_mask, hidden_states)
            attn_metadata = mod.AttentionMetadata(attn_mask=torch.cat([txt_mask, img_mask], dim=1))
            if stats is not None:
                stats["masked_calls"] += 1
        joint_hidden_states = m["attn"](query, key, value, attn_metadata)
    return joint_hidden_states.flatten(2, 3).to(query.dtype)


def _keep_all_if_none(mask: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    return mask if mask is not None else torch.ones(x.shape[:2], dtype=torch.bool, device=x.device)


def traced_forward(
    mod: Any,
    attn: Any,
    hidden_states: torch.Tensor,
    encoder_hidden_states: torch.Tensor,
    vid_freqs: torch.Tensor,
    txt_freqs: torch.Tensor,
    hidden_states_mask: torch.Tensor | None,
    encoder_hidden_states_mask: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The joint path for dynamo: layers as modules, the joint norm without ``out=``, RoPE tables hoisted
    (:data:`READY_ROPE`, regional compile) or computed in the graph. None: stock must run."""
    streams = (hidden_states, encoder_hidden_states, vid_freqs, txt_freqs)
    if static_reason(attn) or shape_reason(attn, *streams) or any_cuda_fused(attn, *streams):
        return None  # the eager path's checks that hold for a traced call (the graph is guarded on them)
    m = attn._modules
    img_qkv = m["to_qkv"](hidden_states)[0]
    txt_qkv = m["add_kv_proj"](encoder_hidden_states)[0]
    if img_qkv.dtype != txt_qkv.dtype or img_qkv.shape[-1] != txt_qkv.shape[-1] or img_qkv.shape[0] != txt_qkv.shape[0]:
        return None  # the projections disagree
    d = attn.head_dim
    nq, nkv = attn.query_num_heads, attn.kv_num_heads
    st = encoder_hidden_states.shape[1]
    query, key, value = torch.cat([txt_qkv, img_qkv], dim=1).split([nq * d, nkv * d, nkv * d], dim=-1)
    norm_q, norm_k = m["norm_q"], m["norm_k"]  # each with its stream twin's eps (static_reason)
    query = graph_joint_rms_norm(query.unflatten(-1, (nq, d)), st, m["norm_added_q"].weight, norm_q.weight, norm_q.eps)
    key = graph_joint_rms_norm(key.unflatten(-1, (nkv, d)), st, m["norm_added_k"].weight, norm_k.weight, norm_k.eps)
    value = value.unflatten(-1, (nkv, d))
    tables = compiled_blocks.ready(attn, READY_ROPE)
    if tables is None or tables[0].dtype != query.dtype:
        tables = rope_tables.graph_tables(torch.cat([txt_freqs, vid_freqs], dim=0), query.dtype)
    query = rope_tables.apply_portable(query, *tables)
    key = rope_tables.apply_portable(key, *tables)
    masks = (hidden_states_mask, encoder_hidden_states_mask)
    out = attend(mod, attn, query, key, value, st, hidden_states, encoder_hidden_states, *masks)
    return m["to_out"](out[:, st:, :]), m["to_add_out"](out[:, :st, :])
