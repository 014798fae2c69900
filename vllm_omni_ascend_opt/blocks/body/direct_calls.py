"""Direct calls of layers whose behaviour is known (vLLM's unquantized linears, vLLM-Omni's ``FeedForward``, plain
layer norms): the very ops their module path ends in, without its host time; nothing changes on the device.
:func:`linear_args` / :func:`mlp_args` / :func:`layer_norm_args` say per call whether a layer is exactly what the
direct call mirrors (:data:`~..upstream.targets.DIRECT_CALLS`, checked by fingerprint); process-wide facts are
decided once per forward (:func:`decided`, asked once per block and passed down). Callers check ``guards.tracing()``
first.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from vllm_omni_ascend_opt.blocks.upstream import fingerprints, forward_scope, targets

_NO_SUBCLASS = torch._C.DisableTorchFunctionSubclass


class _Known:
    """The upstream classes the direct calls mirror, once per set of live functions."""

    def __init__(self) -> None:
        lin = sys.modules[targets.LINEAR]
        norm = sys.modules[targets.NORM]
        tr = sys.modules[targets.TRANSFORMER]
        self.omni_ln = norm.LayerNorm
        # vLLM-Omni's LayerNorm dispatches per instance (CustomOp): these run forward_native
        native = [norm.LayerNorm.forward_native, norm.LayerNorm.forward_cuda, norm.LayerNorm.forward_hip]
        if not getattr(norm, "_HAS_MINDIESD", True):
            native.append(norm.LayerNorm.forward_npu)
        self.omni_ln_native = frozenset(native)
        self.uq = lin.UnquantizedLinearMethod
        self.default_gemm = sys.modules[targets.LINEAR_UTILS].default_unquantized_gemm
        self.linear_kinds: dict[type, str] = {
            lin.ReplicatedLinear: "replicated",
            lin.ColumnParallelLinear: "column",
            lin.QKVParallelLinear: "column",
            lin.RowParallelLinear: "row",
        }
        self.ff = tr.FeedForward
        self.gelu = tr.ColumnParallelApproxGELU
        self.plain_tf = {  # __torch_function__ implementations that only strip the parameter subclass
            torch._C._disabled_torch_function_impl,
            sys.modules[targets.PARAMETER].BasevLLMParameter.__torch_function__.__func__,
        }
        self.reason = "; ".join(fingerprints.reasons(targets.DIRECT_CALLS, "the direct calls")) or None
        self.plain_types: set[type] = set()  # parameter classes :func:`_plain_param` passed in this forward


_KNOWN: dict[tuple[int, ...], _Known] = {}


def decided() -> _Known | str:
    """The verified upstream, or why no layer is called directly: decided once per transformer forward."""
    return forward_scope.decide("direct_calls.process", _decide)


def _decide() -> _Known | str:
    mods = (targets.LINEAR, targets.LINEAR_UTILS, targets.PARAMETER, targets.NORM, targets.TRANSFORMER)
    if not all(m in sys.modules for m in mods):
        return "vLLM's linear layers are not imported"
    ident = tuple(id(fingerprints.live(d.module, d.qualname)[1]) for d in targets.DIRECT_CALLS)
    k = _KNOWN.get(ident)
    if k is None:
        _KNOWN.clear()
        k = _KNOWN[ident] = _Known()
    if k.reason:
        return k.reason
    k.plain_types = {torch.Tensor, type(None)}  # a class's __torch_function__ may change between forwards
    from vllm.platforms import current_platform

    if current_platform.is_cuda_alike() or current_platform.is_xpu():  # apply() reads the flag on these platforms
        envs = sys.modules.get("vllm.envs")
        if envs is not None and envs.VLLM_BATCH_INVARIANT:
            return "VLLM_BATCH_INVARIANT selects vLLM's batch-invariant GEMM"
    return k


def _plain(*mods: nn.Module) -> bool:
    """No module of ``mods`` carries forward hooks or an instance ``forward``."""
    for m in mods:
        if m._forward_hooks or m._forward_pre_hooks or "forward" in m.__dict__:
            return False
    return True


def _plain_param(t: Any, k: _Known) -> bool:
    """Whether ``t``'s class (not yet in ``k.plain_types``) only strips its subclass; learned for this forward."""
    cls = type(t)
    tf = cls.__torch_function__
    if getattr(tf, "__func__", tf) not in k.plain_tf:
        return False
    k.plain_types.add(cls)
    return True


def linear_args(layer: nn.Module, k: _Known | str) -> tuple[torch.Tensor, torch.Tensor | None] | str:
    """``(weight, bias)`` of ``layer`` when calling ``F.linear`` directly is exactly its module path, else why not
    (``k``: :func:`decided`)."""
    if isinstance(k, str):
        return k
    kind = k.linear_kinds.get(type(layer))
    if kind is None:
        return f"{type(layer).__name__} is not a plain vLLM linear (quantized, LoRA or platform layer)"
    d = layer.__dict__
    if layer._forward_hooks or layer._forward_pre_hooks or "forward" in d:  # not _plain(layer), inlined
        return "hooks or an instance forward on a linear"
    qm = d.get("quant_method")
    if type(qm) is not k.uq or qm.__dict__.get("_gemm_impl") is not k.default_gemm:
        return "the linear's quant method is not vLLM's UnquantizedLinearMethod with the default GEMM"
    if d.get("skip_bias_add") or (d.get("tp_size") or 1) != 1:
        return "a tensor-parallel or skip_bias_add linear"
    if kind == "row" and not d.get("input_is_parallel"):
        return "a row-parallel linear whose input is split inside"
    p = layer._parameters
    w, b = p.get("weight"), p.get("bias")
    plain = k.plain_types
    if w is None or not (type(w) in plain or _plain_param(w, k)) or not (type(b) in plain or _plain_param(b, k)):
        return "a linear weight with its own __torch_function__ (DTensor, quantized tensor)"
    return w, b


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` without the parameter subclass's ``__torch_function__`` (which only strips it)."""
    with _NO_SUBCLASS():
        return F.linear(x, weight, bias)


def mlp_args(ff: nn.Module, k: _Known | str) -> tuple[Any, ...] | str:
    """``(w1, b1, approximate, w2, b2)`` of vLLM-Omni's ``FeedForward`` when its three kernels are its module path."""
    if isinstance(k, str):
        return k
    net = ff._modules.get("net")
    if type(ff) is not k.ff or not _plain(ff) or type(net) is not nn.ModuleList or len(net._modules) != 3:
        return "FeedForward is not vLLM-Omni's (linear, GELU, Identity, linear), or carries hooks"
    act, ident, out = net._modules.values()
    if type(act) is not k.gelu or type(ident) is not nn.Identity or not _plain(act, ident, net):
        return "FeedForward.net is not (ColumnParallelApproxGELU, Identity, linear), or carries hooks"
    first, second = linear_args(act._modules["proj"], k), linear_args(out, k)
    for args in (first, second):
        if isinstance(args, str):
            return args
    return (*first, act.approximate or "none", *second)


def mlp(x: torch.Tensor, args: tuple[Any, ...]) -> torch.Tensor:
    """vLLM-Omni's ``FeedForward`` as its three kernels (see :func:`mlp_args`)."""
    w1, b1, approximate, w2, b2 = args
    with _NO_SUBCLASS():
        return F.linear(F.gelu(F.linear(x, w1, b1), approximate=approximate), w2, b2)


def layer_norm_args(ln: nn.Module, k: _Known | str) -> tuple[Any, ...] | None:
    """``(normalized_shape, weight, bias, eps, upcast)`` of a hook-free ``nn.LayerNorm`` or vLLM-Omni ``LayerNorm``
    dispatched to ``forward_native`` (``upcast``: fp32 and back), else None (global hooks: the caller's guard)."""
    if ln._forward_hooks or ln._forward_pre_hooks or "forward" in ln.__dict__:  # not _plain(ln), inlined
        return None
    p = ln._parameters
    args = (ln.normalized_shape, p.get("weight"), p.get("bias"), ln.eps)
    if type(ln) is nn.LayerNorm:
        return (*args, False)
    if isinstance(k, str):
        return None
    if (
        type(ln) is not k.omni_ln
        or getattr(ln.__dict__.get("_forward_method"), "__func__", None) not in k.omni_ln_native
    ):
        return None
    return (*args, True)


def layer_norm(x: torch.Tensor, args: tuple[Any, ...]) -> torch.Tensor:
    """The layer norm :func:`layer_norm_args` describes, as its forward computes it."""
    shape, w, b, eps, upcast = args
    dtype = x.dtype
    with _NO_SUBCLASS():
        if upcast:
            x, w, b = x.float(), w.float() if w is not None else None, b.float() if b is not None else None
        if torch._C._is_torch_function_mode_enabled():  # a mode sees F.layer_norm, as from the module
            out = F.layer_norm(x, shape, w, b, eps)
        else:  # F.layer_norm's body: without a mode or a subclass its dispatch check is False
            out = torch.layer_norm(x, shape, w, b, eps, torch._C._get_cudnn_enabled())
        return out.to(dtype) if upcast else out
