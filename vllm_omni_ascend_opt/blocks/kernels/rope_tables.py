"""RoPE cos/sin tables and vLLM-Omni's rotary math, written once for ``rope`` (per stream) and ``joint_attention``
(joint sequence), which must key their tables the same way (:func:`table_key`, :class:`TableCache`).
:func:`apply_portable` is bitwise stock's interleaved ``RotaryEmbedding.forward_native``; it may replace stock's
rotary call only where that call runs the native math (:func:`native_equivalent`).
"""

from __future__ import annotations

import sys
from collections import Counter
from dataclasses import dataclass

import torch
import torch.nn as nn

from vllm_omni_ascend_opt.blocks.weak_lru import WeakLRU, tensor_bytes

#: Tables kept per cache, one per (freqs tensor, dtype).
TABLE_CACHE_SIZE = 32


@dataclass(slots=True, eq=False)
class Tables:
    """cos/sin for one freqs tensor and dtype, built lazily in the forms each path needs; each form is stored whole
    (both tensors at once, once both are built), so a fault while building leaves the entry as it was."""

    dtype: torch.dtype
    half_cos: torch.Tensor | None = None  # stock's cos: real(freqs).to(dtype), [S, D/2]
    half_sin: torch.Tensor | None = None
    cos: torch.Tensor | None = None  # [S, 1, D], repeat-interleaved (portable and, as [1,S,1,D], NPU)
    sin_signed: torch.Tensor | None = None  # [S, 1, D]: (-s0, s0, -s1, s1, ...)
    npu_cos: torch.Tensor | None = None  # [1, S, 1, D]
    npu_sin: torch.Tensor | None = None  # [1, S, 1, D]: (s0, s0, s1, s1, ...)


def half_tables(t: Tables, freqs: torch.Tensor, stats: Counter) -> tuple[torch.Tensor, torch.Tensor]:
    """Stock's ``(real(freqs).to(dtype), imag(freqs).to(dtype))`` [S, D/2], built once (``stats["table_builds"]``)."""
    if t.half_cos is None:
        # stock's conversion, copied when a view of freqs (the cache never pins freqs' storage)
        cos = torch.real(freqs).to(t.dtype)
        sin = torch.imag(freqs).to(t.dtype)
        if cos.data_ptr() == freqs.data_ptr() or cos._base is not None:
            cos, sin = cos.clone(), sin.clone()
        t.half_cos, t.half_sin = cos, sin
        stats["table_builds"] += 1
    return t.half_cos, t.half_sin  # type: ignore[return-value]


def portable_tables(t: Tables, freqs: torch.Tensor, stats: Counter) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin_signed)`` [S, 1, D] for :func:`apply_portable`."""
    if t.cos is None:
        c, s = half_tables(t, freqs, stats)
        # stock's einops ``repeat(c, "... d -> ... 1 (d 2)")``; both built before either is stored
        cos = torch.repeat_interleave(c, 2, dim=-1).unsqueeze(-2)
        sin_signed = torch.stack((-s, s), dim=-1).flatten(-2).unsqueeze(-2)
        t.cos, t.sin_signed = cos, sin_signed
    return t.cos, t.sin_signed  # type: ignore[return-value]


def npu_tables(t: Tables, freqs: torch.Tensor, stats: Counter) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)`` [1, S, 1, D] repeat-interleaved: ``npu_rotary_mul``'s 1S1D class for BSND inputs."""
    if t.npu_sin is None:
        cos, _ = portable_tables(t, freqs, stats)
        sin = torch.repeat_interleave(t.half_sin, 2, dim=-1)[None, :, None, :]  # type: ignore[arg-type]
        t.npu_cos, t.npu_sin = cos.unsqueeze(0), sin  # cos: a view of the portable table
    return t.npu_cos, t.npu_sin  # type: ignore[return-value]


def version_or_none(t: torch.Tensor) -> int | None:
    """``t._version``, or None for inference tensors (they track none; upstream never writes freqs in place)."""
    if t.is_inference():  # asked first: reading an inference tensor's version raises
        return None
    try:
        return t._version
    except RuntimeError:
        return None


def table_key(freqs: torch.Tensor, dtype: torch.dtype) -> tuple[tuple, torch.Tensor]:
    """``(key, root)``: what identifies the tables of ``freqs`` in ``dtype`` (a view by its base and geometry), and
    the tensor the entry lives with (the key holds ``id(root)``: a cache checks ``root`` through a weak reference)."""
    base = freqs._base
    root = base if base is not None else freqs
    key = (
        id(root),
        freqs.storage_offset(),
        tuple(freqs.shape),
        freqs.stride(),
        freqs.dtype,
        freqs.device,
        version_or_none(freqs),
        dtype,
    )
    return key, root


class TableCache:
    """Tables per freqs tensor (weakly, by identity) and dtype, each dropped when its freqs (root) tensor dies."""

    def __init__(self, stats: Counter) -> None:
        self._entries: WeakLRU[Tables] = WeakLRU(TABLE_CACHE_SIZE)
        self._stats = stats

    def clear(self) -> None:
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)

    def nbytes(self) -> int:
        """Bytes of every table held (each form built so far)."""
        return tensor_bytes([[getattr(t, name) for name in Tables.__slots__] for t in self._entries.values()])

    def get(self, freqs: torch.Tensor, dtype: torch.dtype) -> Tables:
        """The tables of ``freqs`` in ``dtype`` (``stats["table_hits"]`` on a hit), or a new, empty entry."""
        key, root = table_key(freqs, dtype)
        hit = self._entries.get(key, (root,))
        if hit is not None:
            self._stats["table_hits"] += 1
            return hit
        return self._entries.put(key, (root,), Tables(dtype))


def graph_tables(freqs: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin_signed)`` of :func:`portable_tables` as tensor ops only, for traced code with no hoisted table."""
    c = torch.real(freqs).to(dtype)
    s = torch.imag(freqs).to(dtype)
    return torch.repeat_interleave(c, 2, dim=-1).unsqueeze(-2), torch.stack((-s, s), dim=-1).flatten(-2).unsqueeze(-2)


def swap_pairs(x: torch.Tensor) -> torch.Tensor:
    """(x1, x0, x3, x2, ...): stock's interleaved ``rotate_half`` without its negation (folded into sin)."""
    return torch.stack((x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)


def apply_portable(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """Bitwise ``RotaryEmbedding(is_neox_style=False).forward_native`` on [B, S, N, D] ``x`` with [S, 1, rotary_dim]
    tables: stock's operations in stock's order per element ((-a)*b == a*(-b) in IEEE arithmetic), in fewer launches."""
    ro_dim = cos.shape[-1]
    if ro_dim == x.shape[-1]:
        return x * cos + swap_pairs(x) * sin_signed
    xr = x[..., :ro_dim]
    return torch.cat([xr * cos + swap_pairs(xr) * sin_signed, x[..., ro_dim:]], dim=-1)


def apply_portable_(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """:func:`apply_portable` in place into ``x`` (the caller owns it and no longer needs it): the same ops on the same
    values, one temporary instead of three. Returns ``x``."""
    ro_dim = cos.shape[-1]
    xr = x if ro_dim == x.shape[-1] else x[..., :ro_dim]
    rotated = swap_pairs(xr)  # before xr changes
    rotated.mul_(sin_signed)
    xr.mul_(cos)
    xr.add_(rotated)
    return x


def native_equivalent(rope: nn.Module) -> bool:
    """True when stock's ``rope(x, cos, sin)`` runs ``RotaryEmbedding.forward_native`` (interleaved, half-dim)."""
    mod = sys.modules.get("vllm_omni.diffusion.layers.rope")
    if mod is None:
        return False
    cls = mod.RotaryEmbedding
    if type(rope) is not cls or "forward" in rope.__dict__ or not (rope.interleaved and rope.half_head_dim):
        return False
    fm = getattr(rope, "_forward_method", None)
    if getattr(fm, "__self__", None) is not rope:
        return False
    func = getattr(fm, "__func__", None)
    if func is cls.forward_native:
        return True
    if func is cls.forward_npu:  # without MindIE-SD it is forward_native
        return not rope.has_mindie
    custom_op = sys.modules.get("vllm_omni.diffusion.layers.custom_op")
    return custom_op is not None and func is custom_op.CustomOp.forward_xpu  # calls forward_native
