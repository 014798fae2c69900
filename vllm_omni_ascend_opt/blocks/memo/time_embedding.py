"""What the time-embedding memo keys on: ``time_text_embed(timestep, hidden_states, addition_t_cond)`` is a function
of the timestep's value, the activation dtype, the additional condition's value, its weights and the numerical
settings. A repeated timestep returns the very temb computed first, which the block memo finds by identity.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from vllm_omni_ascend_opt.blocks.memo.keys import Unkeyable, linear_sig
from vllm_omni_ascend_opt.blocks.upstream import fingerprints, guards, targets

#: Per set of live function objects: why the time embedding is not memoized (None: its code is the known one).
_VERIFIED: dict[tuple[int, ...], str | None] = {}


def upstream_reason() -> str | None:
    """Why the time embedding cannot be memoized here (upstream code differs), or None."""
    if targets.EMBEDDINGS not in sys.modules or targets.TRANSFORMER not in sys.modules:
        return "diffusers' embeddings or the Qwen-Image transformer are not imported"
    ident = tuple(id(fingerprints.live(d.module, d.qualname)[1]) for d in targets.TIME_EMBEDDING)
    if ident not in _VERIFIED:
        _VERIFIED[ident] = "; ".join(fingerprints.reasons(targets.TIME_EMBEDDING, "the time-embedding memo")) or None
    return _VERIFIED[ident]


def value_key(t: torch.Tensor) -> tuple[Any, ...]:
    """The exact value of a small tensor as a key: dtype, shape, device and its bytes (one device->host copy)."""
    data = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return (t.dtype, tuple(t.shape), str(t.device), data)


def _tensor_sig(t: torch.Tensor) -> tuple[Any, ...]:
    try:
        return (id(t), t._version, t.shape, t.dtype, t.device)
    except RuntimeError:
        raise Unkeyable("time-embedding weights are inference tensors (no version counter)") from None


@dataclass(frozen=True, slots=True)
class TimeKey:
    """What the memo keys a ``QwenTimestepProjEmbeddings`` call on besides its inputs."""

    sig: tuple[Any, ...]  # (module id, time projection settings, use_add, padding_idx, each weight signature)
    tensors: tuple[Any, ...]  # the modules and tensors ``sig`` names by identity
    use_add: bool  # stock reads ``addition_t_cond``


def time_key(module: nn.Module) -> TimeKey:
    """The :class:`TimeKey` of a ``QwenTimestepProjEmbeddings`` (grad off); :class:`Unkeyable` if a key may miss."""
    e = sys.modules[targets.EMBEDDINGS]
    m = module._modules
    proj, emb = m.get("time_proj"), m.get("timestep_embedder")
    if type(proj) is not e.Timesteps or type(emb) is not e.TimestepEmbedding:
        raise Unkeyable(
            "time_text_embed's time_proj / timestep_embedder are not diffusers' Timesteps / TimestepEmbedding"
        )
    if "forward" in module.__dict__ or any(guards.hooked(m) for m in module.modules()):
        raise Unkeyable("hooks or an instance forward in time_text_embed")
    em = emb._modules
    if em.get("cond_proj") is not None or em.get("post_act") is not None or type(em.get("act")) is not nn.SiLU:
        raise Unkeyable("time_text_embed's TimestepEmbedding has a condition projection, post-activation or non-SiLU")
    lin1, lin2 = em["linear_1"], em["linear_2"]
    settings = tuple(getattr(proj, n) for n in ("num_channels", "flip_sin_to_cos", "downscale_freq_shift", "scale"))
    use_add = bool(getattr(module, "use_additional_t_cond", False))
    add = m.get("addition_t_embedding") if use_add else None
    if use_add and (type(add) is not nn.Embedding or add.max_norm is not None):
        raise Unkeyable("time_text_embed's additional-condition embedding is not a plain nn.Embedding")
    add_weights = (add.weight,) if use_add else ()
    add_sig = tuple(_tensor_sig(w) for w in add_weights)
    padding_idx = add.padding_idx if use_add else None
    sig = (id(module), settings, use_add, padding_idx, linear_sig(lin1, False), linear_sig(lin2, False), add_sig)
    return TimeKey(sig, (lin1, lin2, *add_weights), use_add)
