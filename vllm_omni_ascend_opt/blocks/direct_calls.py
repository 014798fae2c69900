"""Direct calls of layers whose behaviour is known: the kernels of vLLM's unquantized linears, vLLM-Omni's
``FeedForward`` and ``nn.LayerNorm``, without re-entering the modules.

Why: on a host-bound NPU every microsecond of Python in the block is device idle time. Calling a vLLM linear as a
module costs ~6 us more than its kernel on a 2-core CPU (``nn.Module.__call__``, ``forward``, the quant method's
``apply``, a ``VLLM_BATCH_INVARIANT`` environment read, the parameter subclass's ``__torch_function__``); a
``FeedForward`` (two linears and a GELU behind five module calls) ~45 us more than its three kernels. The patched
block body and ``joint_attention`` call these layers once per block each.

How: :func:`linear_args` answers, per call, whether a layer is exactly what the direct call mirrors, and returns its
weight and bias: one of :data:`LINEAR_CLASSES` (not a subclass: LoRA wrappers, platform replacements and quantized
layers keep their own path), no hooks or instance ``forward``, vLLM's ``UnquantizedLinearMethod`` (not a subclass)
with the default GEMM (``default_unquantized_gemm``: ``F.linear``), no tensor parallelism (TP > 1 gathers or
all-reduces inside the module), no ``skip_bias_add``, row-parallel input already parallel, weight and bias whose
``__torch_function__`` is the plain one (``nn.Parameter``'s or vLLM's ``BasevLLMParameter``'s, which only strip the
subclass). :func:`linear` then runs ``F.linear(x, weight, bias)`` with the subclass dispatch switched off, the very
call the module path ends in: bitwise the same. :func:`mlp_args` / :func:`mlp` do the same for ``FeedForward``
(``F.linear``, ``F.gelu(approximate=...)``, ``F.linear``) and :func:`layer_norm_args` for ``nn.LayerNorm``.

The upstream functions these calls mirror are fingerprinted (source SHA-256, :data:`FINGERPRINTS`), checked once
per function object: a different upstream keeps every module on its own path, with the reason. Process-wide facts
(the environment, the platform's GEMM) are decided once per transformer forward
(:func:`~.forward_scope.decide`); everything about a layer instance is checked per call (a few attribute reads), so
a hook added or a layer swapped between forwards is seen at once. Callers check ``guards.tracing()`` first.
"""

from __future__ import annotations

import hashlib
import inspect
import sys
import textwrap
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from vllm_omni_ascend_opt.blocks import forward_scope, targets
from vllm_omni_ascend_opt.blocks.stamps import UNRECORDED, Reader

LINEAR_MODULE = "vllm.model_executor.layers.linear"
GEMM_MODULE = "vllm.model_executor.layers.utils"
PARAMETER_MODULE = "vllm.model_executor.parameter"
NORM_MODULE = "vllm_omni.diffusion.layers.norm"

#: SHA-256 (first 16 hex digits) of the dedented source of each upstream function the direct calls mirror (vLLM as
#: pinned by vLLM-Omni 0.30, torch 2.13). A mismatch keeps the layers on their module path.
FINGERPRINTS: dict[str, str] = {
    "ReplicatedLinear.forward": "0509484a019dc9a6",
    "ColumnParallelLinear.forward": "a83e0a998236fbef",
    "QKVParallelLinear.forward": "a83e0a998236fbef",
    "RowParallelLinear.forward": "6f282baaa162ded9",
    "UnquantizedLinearMethod.apply": "849ee397279b9b72",
    "default_unquantized_gemm": "046576d5cfcb9a40",
    "FeedForward.forward": "c600e6f33fe6119a",
    "ColumnParallelApproxGELU.forward": "3433c7a2c2700355",
    "LayerNorm.forward": "29d655f9844bd1d5",
    "omni.LayerNorm.forward": "f5141956f3353fa0",
    "omni.LayerNorm.forward_native": "aeccdfbbc9f7927b",
    "omni.LayerNorm.forward_cuda": "afe38032434620d2",
    "omni.LayerNorm.forward_hip": "c351562493d6e6de",
    "omni.LayerNorm.forward_npu": "42aaeca4199b5577",
    "BasevLLMParameter.__torch_function__": "93ab4e0b466afb93",
}

_NO_SUBCLASS = torch._C.DisableTorchFunctionSubclass


def _fingerprint(fn: Any) -> str:
    try:
        src = textwrap.dedent(inspect.getsource(fn))
    except (OSError, TypeError):
        return "source unavailable"
    return hashlib.sha256(src.encode()).hexdigest()[:16]


class _Known:
    """The upstream classes and functions, looked up once, and whether their code is the mirrored one."""

    def __init__(self) -> None:
        lin = sys.modules[LINEAR_MODULE]
        gemm = sys.modules[GEMM_MODULE]
        par = sys.modules[PARAMETER_MODULE]
        tr = sys.modules[targets.TRANSFORMER]
        norm = sys.modules[NORM_MODULE]
        self.omni_ln = norm.LayerNorm
        # vLLM-Omni's LayerNorm dispatches per instance (CustomOp): these run forward_native (npu without MindIE-SD)
        native = [norm.LayerNorm.forward_native, norm.LayerNorm.forward_cuda, norm.LayerNorm.forward_hip]
        if not getattr(norm, "_HAS_MINDIESD", True):
            native.append(norm.LayerNorm.forward_npu)
        self.omni_ln_native = frozenset(native)
        self.uq = lin.UnquantizedLinearMethod
        self.default_gemm = gemm.default_unquantized_gemm
        #: class -> "replicated" / "column" / "row"
        self.linear_kinds: dict[type, str] = {
            lin.ReplicatedLinear: "replicated",
            lin.ColumnParallelLinear: "column",
            lin.QKVParallelLinear: "column",
            lin.RowParallelLinear: "row",
        }
        self.ff = tr.FeedForward
        self.gelu = tr.ColumnParallelApproxGELU
        #: __torch_function__ implementations (functions, not bound methods) that only strip the parameter subclass.
        self.plain_tf = {
            torch._C._disabled_torch_function_impl,
            par.BasevLLMParameter.__torch_function__.__func__,
        }
        #: name -> (owner, attribute): the upstream code the direct calls mirror (verified by fingerprint once).
        self.sources: dict[str, tuple[Any, str]] = {
            "ReplicatedLinear.forward": (lin.ReplicatedLinear, "forward"),
            "ColumnParallelLinear.forward": (lin.ColumnParallelLinear, "forward"),
            "QKVParallelLinear.forward": (lin.QKVParallelLinear, "forward"),
            "RowParallelLinear.forward": (lin.RowParallelLinear, "forward"),
            "UnquantizedLinearMethod.apply": (lin.UnquantizedLinearMethod, "apply"),
            "default_unquantized_gemm": (gemm, "default_unquantized_gemm"),
            "FeedForward.forward": (tr.FeedForward, "forward"),
            "ColumnParallelApproxGELU.forward": (tr.ColumnParallelApproxGELU, "forward"),
            "LayerNorm.forward": (nn.LayerNorm, "forward"),
            "omni.LayerNorm.forward": (norm.LayerNorm, "forward"),
            "omni.LayerNorm.forward_native": (norm.LayerNorm, "forward_native"),
            "omni.LayerNorm.forward_cuda": (norm.LayerNorm, "forward_cuda"),
            "omni.LayerNorm.forward_hip": (norm.LayerNorm, "forward_hip"),
            "omni.LayerNorm.forward_npu": (norm.LayerNorm, "forward_npu"),
            "BasevLLMParameter.__torch_function__": (par.BasevLLMParameter, "__torch_function__"),
        }
        self.objects = {name: _lookup(owner, attr) for name, (owner, attr) in self.sources.items()}
        self._checks = [(owner, attr, self.objects[name]) for name, (owner, attr) in self.sources.items()]
        self.reason = self._verify()
        from vllm.platforms import current_platform

        self.batch_invariant_platform = bool(current_platform.is_cuda_alike() or current_platform.is_xpu())

    def _verify(self) -> str | None:
        bad = []
        for name, fn in self.objects.items():
            got = _fingerprint(getattr(fn, "__func__", fn))  # classmethod objects carry the function
            if got != FINGERPRINTS[name]:
                bad.append(f"{name} (source fingerprint {got}, expected {FINGERPRINTS[name]})")
        if bad:
            return "upstream code differs from what the direct calls mirror: " + ", ".join(bad)
        return None

    def current(self) -> bool:
        """Nobody replaced a verified function since (a patch elsewhere re-verifies)."""
        for owner, attr, obj in self._checks:
            if _lookup(owner, attr) is not obj:
                return False
        return True


def _lookup(owner: Any, attr: str) -> Any:
    """``owner.attr`` as stored (a class's classmethod object, not a fresh bound method), found along the MRO."""
    if isinstance(owner, type):
        for cls in owner.__mro__:
            if attr in cls.__dict__:
                return cls.__dict__[attr]
        return None
    return getattr(owner, attr, None)


#: ``{"known": the verified upstream}`` (a mapping, so that a stamp can record which one a plan was made with)
_KNOWN_SLOT: dict[str, _Known] = {}


def known() -> _Known | None:
    """The verified upstream classes (None until vLLM's linear module and the Qwen-Image transformer are imported)."""
    k = _KNOWN_SLOT.get("known")
    if k is not None and k.current():
        return k
    _KNOWN_SLOT.clear()
    if not all(
        m in sys.modules for m in (LINEAR_MODULE, GEMM_MODULE, PARAMETER_MODULE, NORM_MODULE, targets.TRANSFORMER)
    ):
        return None
    k = _KNOWN_SLOT["known"] = _Known()
    return k


def process_reason() -> str | None:
    """Why no layer is called directly in this forward (None: instances decide): upstream code that differs from
    the mirrored one, or vLLM's batch-invariant GEMM on a CUDA-like or XPU platform. Decided once per forward."""
    return forward_scope.decide("direct_calls.process", _process_reason)


def _process_reason() -> str | None:
    k = known()
    if k is None:
        return "vLLM's linear layers are not imported"
    if k.reason:
        return k.reason
    if k.batch_invariant_platform:  # UnquantizedLinearMethod.apply reads the flag on CUDA-like and XPU platforms
        envs = sys.modules.get("vllm.envs")
        if envs is not None and envs.VLLM_BATCH_INVARIANT:
            return "VLLM_BATCH_INVARIANT selects vLLM's batch-invariant GEMM"
    return None


def _plain_param(t: Any, k: _Known, r: Reader) -> bool:
    if t is None:
        return True
    cls = r.kind(t)
    if cls is torch.Tensor:
        return True
    tf = cls.__torch_function__
    return getattr(tf, "__func__", tf) in k.plain_tf


def linear_args(layer: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None] | str:
    """``(weight, bias)`` of ``layer`` when calling ``F.linear`` directly is exactly its module path, else why not."""
    why = process_reason()
    if why:
        return why
    return linear_instance(layer, UNRECORDED)


def _known_now(r: Reader) -> _Known:
    """The verified upstream (after :func:`process_reason` said None), recorded: a re-verification breaks a stamp."""
    return r.read(_KNOWN_SLOT, "known")


def instance_known(r: Reader) -> bool:
    """Whether the upstream classes are known (imported; verified or not), recorded through ``r``: the ``*_instance``
    checks need them. A plan made without them is remade once they are."""
    known()
    return _known_now(r) is not None


def linear_instance(layer: nn.Module, r: Reader) -> tuple[torch.Tensor, torch.Tensor | None] | str:
    """:func:`linear_args` without the per-forward process check (the caller made it), reading through ``r``."""
    k = _known_now(r)
    kind = k.linear_kinds.get(r.kind(layer))
    if kind is None:
        return f"{type(layer).__name__} is not a plain vLLM linear (quantized, LoRA or platform layer)"
    if not r.module(layer):
        return "hooks or an instance forward on a linear"
    d = layer.__dict__
    qm = r.read(d, "quant_method")
    if r.kind(qm) is not k.uq or r.read(qm.__dict__, "_gemm_impl") is not k.default_gemm:
        return "the linear's quant method is not vLLM's UnquantizedLinearMethod with the default GEMM"
    if r.read(d, "skip_bias_add") or (r.read(d, "tp_size") or 1) != 1:
        return "a tensor-parallel or skip_bias_add linear"
    if kind == "row" and not r.read(d, "input_is_parallel"):
        return "a row-parallel linear whose input is split inside"
    params = d["_parameters"]
    w, b = r.read(params, "weight"), r.read(params, "bias")
    if w is None or not _plain_param(w, k, r) or not _plain_param(b, k, r):
        return "a linear weight with its own __torch_function__ (DTensor, quantized tensor)"
    return w, b


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` without the parameter subclass's ``__torch_function__`` (which only strips it)."""
    with _NO_SUBCLASS():
        return F.linear(x, weight, bias)


def mlp_args(ff: nn.Module) -> tuple[Any, ...] | str:
    """``(w1, b1, approximate, w2, b2)`` of vLLM-Omni's ``FeedForward`` (linear, GELU, Identity, linear) when the
    three kernels are exactly its module path, else why not."""
    why = process_reason()
    if why:
        return why
    return mlp_instance(ff, UNRECORDED)


def mlp_instance(ff: nn.Module, r: Reader) -> tuple[Any, ...] | str:
    """:func:`mlp_args` without the per-forward process check (the caller made it), reading through ``r``."""
    k = _known_now(r)
    if r.kind(ff) is not k.ff or not r.module(ff):
        return "FeedForward is not vLLM-Omni's (or carries hooks)"
    net = r.read(ff._modules, "net")
    if r.kind(net) is not nn.ModuleList:
        return "FeedForward.net is not (ColumnParallelApproxGELU, Identity, linear)"
    nm = net._modules
    mods = [r.read(nm, str(i)) for i in range(4)]
    if mods[3] is not None or any(m is None for m in mods[:3]):
        return "FeedForward.net is not (ColumnParallelApproxGELU, Identity, linear)"
    act, ident, out = mods[:3]
    if r.kind(act) is not k.gelu or r.kind(ident) is not nn.Identity:
        return "FeedForward.net is not (ColumnParallelApproxGELU, Identity, linear)"
    if not (r.module(act) and r.module(ident) and r.module(net)):
        return "hooks on a FeedForward submodule"
    first = linear_instance(r.read(act._modules, "proj"), r)
    if isinstance(first, str):
        return first
    second = linear_instance(out, r)
    if isinstance(second, str):
        return second
    return (*first, r.read(act.__dict__, "approximate") or "none", *second)


def mlp(x: torch.Tensor, args: tuple[Any, ...]) -> torch.Tensor:
    """vLLM-Omni's ``FeedForward`` as its three kernels (see :func:`mlp_args`)."""
    w1, b1, approximate, w2, b2 = args
    with _NO_SUBCLASS():
        return F.linear(F.gelu(F.linear(x, w1, b1), approximate=approximate), w2, b2)


def layer_norm_args(ln: nn.Module, r: Reader = UNRECORDED) -> tuple[Any, ...] | None:
    """``(normalized_shape, weight, bias, eps, upcast)`` of a layer norm whose forward is one ``F.layer_norm``: a
    plain ``nn.LayerNorm``, or vLLM-Omni's ``LayerNorm`` dispatched to ``forward_native`` (``upcast``: it runs in
    fp32 and casts back), without hooks; else None (call the module). Global module hooks are the caller's guard;
    ``r`` records what is read (a :class:`~.stamps.Stamp`)."""
    if not r.module(ln):
        return None
    cls = r.kind(ln)
    d = ln.__dict__
    p = d["_parameters"]
    args = (r.read(d, "normalized_shape"), r.read(p, "weight"), r.read(p, "bias"), r.read(d, "eps"))
    if cls is nn.LayerNorm:
        return (*args, False)
    k = known()
    if k is None or k.reason or cls is not k.omni_ln:
        return None
    _known_now(r)
    fn = getattr(r.read(d, "_forward_method"), "__func__", None)
    if fn not in k.omni_ln_native:
        return None
    return (*args, True)


#: the C getter behind ``torch.backends.cudnn.enabled`` (a Python property per read)
_cudnn_enabled = getattr(torch._C, "_get_cudnn_enabled", None) or (lambda: torch.backends.cudnn.enabled)


def layer_norm(x: torch.Tensor, args: tuple[Any, ...]) -> torch.Tensor:
    """The layer norm :func:`layer_norm_args` describes, as its forward computes it."""
    shape, w, b, eps, upcast = args
    if w is None and b is None:  # no parameter: F.layer_norm's own call, without the subclass guard
        cudnn = _cudnn_enabled()  # what F.layer_norm passes (torch.backends.cudnn.enabled)
        if not upcast:
            return torch.layer_norm(x, shape, None, None, eps, cudnn)
        return torch.layer_norm(x.float(), shape, None, None, eps, cudnn).to(x.dtype)
    with _NO_SUBCLASS():
        if not upcast:
            return F.layer_norm(x, shape, w, b, eps)
        return F.layer_norm(
            x.float(), shape, w.float() if w is not None else None, b.float() if b is not None else None, eps
        ).to(x.dtype)
