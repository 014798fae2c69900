"""What the time-embedding memo keys on: Qwen-Image's ``time_text_embed(timestep, hidden_states, addition_t_cond)``
is a function of the timestep's value, the activation dtype, the additional condition's value, the weights of its two
linears (and of the additional-condition embedding) and the numerical settings, nothing else.

Why: the transformer recomputes the timestep embedding in every forward (a sinusoidal embedding, two linears and a
SiLU: ~15 kernels), and the modulation memo then had to read all of ``temb`` back to the host (B x 3072 values) and
hash it to find its entry. Keyed on the timestep's value instead (B values: one small device->host read, the one
host sync the default stack adds per forward), a repeated timestep returns the very ``temb`` tensor computed the first
time, and the block memo finds its entry by that tensor's identity, with no digest of temb at all.

How: :func:`time_embedding_sig` checks that the module is exactly what the key covers (its class and those of its
parts, no hooks, no condition projection or post-activation, an embedding without ``max_norm``) and returns its
weights' signature; :func:`value_key` is the exact key of a small tensor's value (dtype, shape, device and bytes:
``-0.0`` and ``0.0`` differ, as they do for ``sin``). The upstream functions whose output the key must determine are
fingerprinted (:data:`FINGERPRINTS`, checked once per function object): a different upstream keeps the time
embedding unmemoized, with the reason.
"""

from __future__ import annotations

import hashlib
import inspect
import sys
import textwrap
from typing import Any

import torch
import torch.nn as nn

from vllm_omni_ascend_opt.blocks import guards, targets
from vllm_omni_ascend_opt.blocks.modulation_keys import Unkeyable, linear_sig

EMBEDDINGS_MODULE = "diffusers.models.embeddings"

#: SHA-256 (first 16 hex digits) of the dedented source of each function whose output the key must determine
#: (vLLM-Omni 0.30 / diffusers 0.40 / torch 2.13).
FINGERPRINTS: dict[str, str] = {
    "QwenTimestepProjEmbeddings.forward": "e127246f041ab288",
    "TimestepEmbedding.forward": "7a64747c1e8ed70d",
    "Timesteps.forward": "58794175acc7b12d",
    "get_timestep_embedding": "6028d48c06ba9784",
    "Embedding.forward": "612a591ba15b23d2",
}
_VERIFIED: dict[tuple[int, ...], str | None] = {}


def _fingerprint(fn: Any) -> str:
    try:
        src = textwrap.dedent(inspect.getsource(fn))
    except (OSError, TypeError):
        return "source unavailable"
    return hashlib.sha256(src.encode()).hexdigest()[:16]


def _functions() -> dict[str, Any]:
    t = sys.modules[targets.TRANSFORMER]
    e = sys.modules[EMBEDDINGS_MODULE]
    return {
        "QwenTimestepProjEmbeddings.forward": t.QwenTimestepProjEmbeddings.forward,
        "TimestepEmbedding.forward": e.TimestepEmbedding.forward,
        "Timesteps.forward": e.Timesteps.forward,
        "get_timestep_embedding": e.get_timestep_embedding,
        "Embedding.forward": nn.Embedding.forward,
    }


def upstream_reason() -> str | None:
    """Why the time embedding cannot be memoized in this process (upstream code differs), or None."""
    if EMBEDDINGS_MODULE not in sys.modules or targets.TRANSFORMER not in sys.modules:
        return "diffusers' embeddings or the Qwen-Image transformer are not imported"
    fns = _functions()
    ident = tuple(id(f) for f in fns.values())
    if ident not in _VERIFIED:
        bad = []
        for name, fn in fns.items():
            got = _fingerprint(fn)
            if got != FINGERPRINTS[name]:
                bad.append(f"{name} (source fingerprint {got}, expected {FINGERPRINTS[name]})")
        _VERIFIED[ident] = ("upstream time embedding code differs: " + ", ".join(bad)) if bad else None
    return _VERIFIED[ident]


def value_key(t: torch.Tensor) -> tuple[Any, ...]:
    """The exact value of a small tensor as a key: dtype, shape, device and its bytes (one device->host copy)."""
    host = t.detach().cpu()
    data = host.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return (t.dtype, tuple(t.shape), str(t.device), data)


def _tensor_sig(t: torch.Tensor, grad: bool) -> tuple[Any, ...]:
    if grad and t.requires_grad:
        raise Unkeyable("autograd is recording (grad enabled and a time-embedding weight requires grad)")
    try:
        with torch._C.DisableTorchFunctionSubclass():
            return (id(t), t._version, t.shape, t.dtype, t.device)
    except RuntimeError:
        raise Unkeyable("time-embedding weights are inference tensors (no version counter)") from None


def time_embedding_sig(module: nn.Module, grad: bool) -> tuple[tuple[Any, ...], list[Any]]:
    """``(signature, tensors it names)`` of a ``QwenTimestepProjEmbeddings``: the time projection's settings, the
    weights of its linears and additional-condition embedding. Raises :class:`Unkeyable` when its output may depend
    on anything else (another class, hooks anywhere in it, a condition projection, a post-activation)."""
    e = sys.modules[EMBEDDINGS_MODULE]
    m = module._modules
    proj, emb = m.get("time_proj"), m.get("timestep_embedder")
    if type(proj) is not e.Timesteps or type(emb) is not e.TimestepEmbedding:
        raise Unkeyable(
            "time_text_embed's time_proj / timestep_embedder are not diffusers' Timesteps / TimestepEmbedding"
        )
    if "forward" in module.__dict__ or any(guards.hooked(x) for x in module.modules()):
        raise Unkeyable("hooks or an instance forward in time_text_embed")
    e_mods = emb._modules
    act = e_mods.get("act")
    if e_mods.get("cond_proj") is not None or e_mods.get("post_act") is not None or type(act) is not nn.SiLU:
        raise Unkeyable("time_text_embed's TimestepEmbedding has a condition projection, post-activation or non-SiLU")
    lin1, lin2 = e_mods["linear_1"], e_mods["linear_2"]
    sig: list[Any] = [
        id(module),
        (proj.num_channels, proj.flip_sin_to_cos, proj.downscale_freq_shift, proj.scale),
        linear_sig(lin1, grad),
        linear_sig(lin2, grad),
    ]
    tensors: list[Any] = [lin1, lin2]
    use_add = bool(getattr(module, "use_additional_t_cond", False))
    sig.append(use_add)
    if use_add:
        add = m.get("addition_t_embedding")
        if type(add) is not nn.Embedding or add.max_norm is not None:
            raise Unkeyable("time_text_embed's additional-condition embedding is not a plain nn.Embedding")
        w = add._parameters["weight"]
        sig.append((_tensor_sig(w, grad), add.padding_idx))
        tensors.append(w)
    return tuple(sig), tensors
