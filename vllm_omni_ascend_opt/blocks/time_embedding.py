"""What the time-embedding memo keys on: Qwen-Image's ``time_text_embed(timestep, hidden_states, addition_t_cond)``
is a function of the timestep's value, the activation dtype, the additional condition's value, the weights of its two
linears (and of the additional-condition embedding) and the numerical settings, nothing else.

Why: the transformer recomputes the timestep embedding in every forward (a sinusoidal embedding, two linears and a
SiLU: ~15 kernels), and the modulation memo then had to read all of ``temb`` back to the host (B x 3072 values) and
hash it to find its entry. Keyed on the timestep's value instead (B values: one small device->host read, the one
host sync the default stack adds per forward), a repeated timestep returns the very ``temb`` tensor computed the first
time, and the block memo finds its entry by that tensor's identity, with no digest of temb at all.

How: :func:`time_embedding_plan` checks that the module is exactly what the key covers (its class and those of its
parts, no hooks, no condition projection or post-activation, an embedding without ``max_norm``), recording what it
reads (kept with a :class:`~.stamps.Stamp` by the memo), and :meth:`TimePlan.sig` completes its weights' signature
per call; :func:`value_key` is the exact key of a small tensor's value (dtype, shape, device and bytes:
``-0.0`` and ``0.0`` differ, as they do for ``sin``). The upstream functions whose output the key must determine are
fingerprinted (:data:`FINGERPRINTS`, checked once per function object): a different upstream keeps the time
embedding unmemoized, with the reason.
"""

from __future__ import annotations

import hashlib
import inspect
import sys
import textwrap
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from vllm_omni_ascend_opt.blocks import targets
from vllm_omni_ascend_opt.blocks.modulation_keys import Unkeyable, linear_static, sig_tensors, tensor_state
from vllm_omni_ascend_opt.blocks.stamps import UNRECORDED, Reader

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
    if t.device.type == "cpu" and t.dtype in _NUMPY_DTYPES and t.is_contiguous() and not t.is_neg():
        data = t.detach().numpy().tobytes()  # the same bytes, without the copies a device tensor needs
    else:
        host = t.detach().cpu()
        data = host.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return (t.dtype, tuple(t.shape), str(t.device), data)


#: dtypes whose CPU tensors ``numpy()`` reads as they are (bf16 and the like go through a uint8 view)
_NUMPY_DTYPES = frozenset((torch.float16, torch.float32, torch.float64, torch.int32, torch.int64, torch.uint8))


def _tensor_sig(t: torch.Tensor, grad: bool) -> tuple[Any, ...]:
    if grad and t.requires_grad:
        raise Unkeyable("autograd is recording (grad enabled and a time-embedding weight requires grad)")
    try:
        with torch._C.DisableTorchFunctionSubclass():
            return (id(t), t._version, t.shape, t.dtype, t.device)
    except RuntimeError:
        raise Unkeyable("time-embedding weights are inference tensors (no version counter)") from None


@dataclass(frozen=True, slots=True)
class TimePlan:
    """What :func:`time_embedding_plan` read about a ``QwenTimestepProjEmbeddings`` instance: the signature's
    instance half, and what completes it per call (:meth:`sig`)."""

    #: (id of the module, the time projection's settings, each linear's ``linear_static``, use_add, padding_idx)
    static: tuple[Any, ...]
    lins: tuple[nn.Module, nn.Module]
    #: each linear's tensors (None: walked per call, :func:`~.modulation_keys.sig_tensors`)
    lin_tensors: tuple[tuple[torch.Tensor, ...] | None, tuple[torch.Tensor, ...] | None]
    #: the additional-condition embedding's weight (None: stock ignores ``addition_t_cond``)
    add_weight: torch.Tensor | None

    @property
    def use_add(self) -> bool:
        return self.add_weight is not None

    def sig(self, grad: bool) -> tuple[Any, ...]:
        """The full signature now: the instance half and the weights' state (identity, version, dtype, device)."""
        states = tuple(
            tensor_state(sig_tensors(lin) if t is None else t, grad)
            for lin, t in zip(self.lins, self.lin_tensors, strict=True)
        )
        add = () if self.add_weight is None else (_tensor_sig(self.add_weight, grad),)
        return (self.static, states, add)

    def tensors(self) -> list[Any]:
        """The modules and tensors the signature names by identity (the memo keeps weak references to them)."""
        return [*self.lins, *(() if self.add_weight is None else (self.add_weight,))]


def _hooked_anywhere(module: nn.Module, r: Reader) -> bool:
    if r.hooked(module):
        return True
    children = module._modules
    return any(_hooked_anywhere(c, r) for c in (r.read(children, n) for n in list(children)) if c is not None)


def time_embedding_plan(module: nn.Module, r: Reader = UNRECORDED) -> TimePlan:
    """The :class:`TimePlan` of a ``QwenTimestepProjEmbeddings``, read through ``r``. Raises :class:`Unkeyable` when
    its output may depend on anything the key does not cover (another class, hooks anywhere in it, an instance
    forward, a condition projection, a post-activation, an embedding with ``max_norm``)."""
    e = sys.modules[EMBEDDINGS_MODULE]
    m = module._modules
    proj, emb = r.read(m, "time_proj"), r.read(m, "timestep_embedder")
    if r.kind(proj) is not e.Timesteps or r.kind(emb) is not e.TimestepEmbedding:
        raise Unkeyable(
            "time_text_embed's time_proj / timestep_embedder are not diffusers' Timesteps / TimestepEmbedding"
        )
    if r.read(module.__dict__, "forward") is not None or _hooked_anywhere(module, r):
        raise Unkeyable("hooks or an instance forward in time_text_embed")
    e_mods = emb._modules
    act = r.read(e_mods, "act")
    if r.read(e_mods, "cond_proj") is not None or r.read(e_mods, "post_act") is not None or r.kind(act) is not nn.SiLU:
        raise Unkeyable("time_text_embed's TimestepEmbedding has a condition projection, post-activation or non-SiLU")
    lin1, lin2 = r.read(e_mods, "linear_1"), r.read(e_mods, "linear_2")
    (static1, tensors1), (static2, tensors2) = linear_static(lin1, r), linear_static(lin2, r)
    settings = tuple(r.attr(proj, n) for n in ("num_channels", "flip_sin_to_cos", "downscale_freq_shift", "scale"))
    d = module.__dict__
    if "use_additional_t_cond" in d:
        use_add = bool(r.read(d, "use_additional_t_cond"))
    else:
        use_add = bool(getattr(module, "use_additional_t_cond", False))
    weight, padding_idx = None, None
    if use_add:
        add = r.read(m, "addition_t_embedding")
        if r.kind(add) is not nn.Embedding or r.attr(add, "max_norm") is not None:
            raise Unkeyable("time_text_embed's additional-condition embedding is not a plain nn.Embedding")
        weight, padding_idx = r.read(add._parameters, "weight"), r.attr(add, "padding_idx")
    static = (id(module), settings, static1, static2, use_add, padding_idx)
    return TimePlan(static, (lin1, lin2), (tensors1, tensors2), weight)


def plan_or_reason(module: nn.Module, r: Reader) -> TimePlan | str | None:
    """:func:`time_embedding_plan` as a plan to keep with ``r`` (a :class:`~.stamps.Stamp`): the plan, why the
    module cannot be keyed, or None when a linear's tensors are walked per call (then plan per call)."""
    try:
        plan = time_embedding_plan(module, r)
    except Unkeyable as exc:
        return str(exc)
    return None if None in plan.lin_tensors else plan
