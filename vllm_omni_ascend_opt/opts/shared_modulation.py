"""`shared_modulation`: Compute SiLU(temb) and the per-block modulation projections once per distinct timestep embedding (exact memo), and unpack them once per block into broadcast-ready tensors.

Patched upstream symbols (vLLM-Omni 0.30.x, ``vllm_omni/diffusion/models/qwen_image/qwen_image_transformer.py``)
------------------------------------------------------------------------------------------------------------
* ``QwenImageTransformerBlock.forward`` (class attribute): the block reads its six modulation tensors from a memo.
* ``QwenImageTransformer2DModel.load_weights`` (class attribute): drops the memo after a (re)load.
* per attached transformer (``attach``): the ``img_mod``/``txt_mod`` ``nn.Sequential`` of every block and
  ``norm_out`` (diffusers' ``AdaLayerNormContinuous``) get a memoizing subclass (``__class__`` swap, same object,
  same state dict), so that direct calls such as TeaCache's block-0 probe ``block.img_mod(temb)`` and the final
  ``norm_out(h, temb)`` hit the memo too. ``detach``/``uninstall`` restore the classes by identity.

Why
  Per forward, stock computes SiLU(temb) 2x per block + once in ``norm_out`` and runs ``img_mod``/``txt_mod``
  (3072 -> 18432 each) in every block and ``norm_out.linear``: on real Qwen-Image 121 SiLUs and 121 GEMVs that read
  ~1/3 of all DiT weights, although they depend only on the timestep embedding ``temb``. ``1 + scale`` is
  recomputed four times per block from strided views.
How
  An exact memo (:class:`ModulationMemo`): the key is the *value* of ``temb`` (dtype, shape, device and a SHA-256
  of its bytes, upstream's ``tensor_digest``), the numerical settings (matmul precision, autocast, grad mode,
  TF32/HF32 flags), and, per slot, the modules and their weights (object identity, ``data_ptr``, ``_version``,
  shape, dtype, device; vLLM LoRA stacks and active-slice mask; quant method). A miss replays stock's computation
  (same ops, same inputs, one SiLU per distinct temb), so a hit is bitwise what stock would compute. Each block's
  modulation is stored unpacked ("decode broadcast"): contiguous ``(1 + scale, shift, gate)`` tensors ``[B, 1, D]``
  for its four norms, so a warm step runs no modulation op at all: ``LN(x) * (1 + scale) + shift`` and
  ``h + gate * y`` are the very elementwise ops stock runs, on the same values. Bounded by a byte budget
  (``VLLM_OMNI_ASCEND_OPT_MODULATION_CACHE_MB``, default 512; 0 disables), least-recently-used temb first.
  Costs: one device->host copy of ``temb`` (B x 3072 values) per forward for the digest; on a miss, 8 small copies
  per block to make the unpacked tensors contiguous.
Two-segment modulation (Qwen-Image-Edit-2511, ``zero_cond_t``)
  Stock projects ``img_mod`` over ``temb = [emb(t); emb(0)]`` (2B rows) and, per image norm, builds three
  ``[B, L, D]`` tensors with ``torch.where(modulate_index, segment 1, segment 0)`` (``select01_modulation_native``, the
  stock path on NPU and CPU), then ``LN(x) * (1 + scale) + shift`` and ``gate * y`` over them. Here the block's
  modulation is memoized per temb value like the single-segment one, and the image stream uses per-segment
  broadcast: :class:`SegmentPlan` reads ``modulate_index`` once per forward (its runs of equal values, one
  device->host copy); the sequence is viewed as ``[B, C, L/C, D]`` chunks (``C = L / gcd(run lengths)``, at most
  :data:`MAX_BROADCAST_CHUNKS`; the default edit request has C = 2) and multiplied by ``[B, C, 1, D]`` per-chunk
  ``(1 + scale, shift, gate)`` -- or, for more chunks, each run is computed on its slice with ``out=``. Each
  element sees the same IEEE mul/add on the same two values as in stock, so the result is bitwise stock's; the
  ``where``s, the bool casts and ``1 + scale`` over ``[B, L, D]`` disappear. The timestep-0 segment is kept once per
  block and weights signature for the model's life (reused while bitwise equal to the fresh rows of each missed
  projection; ``zero_t_*`` stats); with slice plans the memo entries of new timesteps then add only their own
  segment (broadcast plans keep small per-chunk copies of both).
Exactness and fallbacks
  Falls back to the stock code, with a reason (:meth:`SharedModulation.fallback_reasons`, debug log), under
  autograd (grad enabled and a tensor requiring grad), ``torch.compile`` tracing, CUDA/NPU graph capture, global
  ``nn.Module`` forward hooks or hooks on the modules it would skip, inference-tensor weights (no version counter),
  unknown projection classes, and, for the edit models' two-segment blocks, the CUDA Triton select01 kernels (stock
  there), a ``modulate_index`` that differs between batch rows, and MindIE-SD's fused image norms (they take per-token
  tensors); those blocks still get their ``img_mod``/``txt_mod`` projections and ``norm_out`` from the memo on an
  attached model (a view of the last temb, such as ``temb.chunk(2)[0]``, is keyed by its geometry, not re-hashed).
  ``AdaLayerNorm`` is applied the way the instance dispatches
  (``forward_native``; ``forward_npu`` via ``torch_npu.npu_layer_norm_eval`` without MindIE-SD; with MindIE-SD the
  fused kernel takes ``scale``, so the memo keeps ``scale`` and calls the norm itself). The mirrored upstream
  functions are fingerprinted (source SHA-256): a different upstream turns the optimization off with a reason.
  Weights written in place through ``.data`` (``param.data.copy_``) bypass version counters: reloads through
  ``load_weights`` invalidate automatically; anything else must call :func:`invalidate`.
Parallel
  The memo is per process (per rank) and runs no collective, so a hit on one rank and a miss on another cannot
  desynchronise anything; the modulation projections are ``ReplicatedLinear`` (identical on every TP rank), temb is
  replicated under Ulysses/ring SP, and each CFG-parallel rank memoizes its own branch.
Upstream PR
  none yet; upstream's ``ExactProjectionCache`` (vllm_omni/diffusion/cache/exact_projection_cache.py) implements the
  same idea for MiniMax-H3 only. Proposal: wire it into Qwen-Image's blocks with unpacked outputs.
Removal plan
  Drop this patch once vLLM-Omni memoizes Qwen-Image's modulation itself (or with a version outside 0.30.x, where the
  fingerprints stop matching and it turns itself off).
"""

from __future__ import annotations

import hashlib
import inspect
import logging
import math
import os
import sys
import textwrap
import weakref
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.modules import module as _torch_module

from vllm_omni_ascend_opt import _backend
from vllm_omni_ascend_opt.blocks import targets as _targets
from vllm_omni_ascend_opt.optimization import PARALLEL_MODES, Optimization

logger = logging.getLogger("vllm_omni_ascend_opt.shared_modulation")

ENV_BUDGET_MB = "VLLM_OMNI_ASCEND_OPT_MODULATION_CACHE_MB"
DEFAULT_BUDGET_MB = 512

ADALAYERNORM_MODULE = "vllm_omni.diffusion.layers.adalayernorm"
CUSTOM_OP_MODULE = "vllm_omni.diffusion.layers.custom_op"
SELECT01_MODULE = "vllm_omni.diffusion.layers.qwen_select01_modulation"

#: Two-segment blocks: at most this many equal-length chunks of the image sequence are modulated with one broadcast
#: (``[B, C, 1, D]`` tensors per norm); more (segments of coprime lengths) use per-segment slices.
MAX_BROADCAST_CHUNKS = 16

#: SHA-256 (first 16 hex digits) of the dedented source of each upstream function this patch mirrors, as shipped in
#: vLLM-Omni 0.30.0 / diffusers 0.40. A mismatch means upstream changed and the exactness argument must be redone.
FINGERPRINTS: dict[str, str] = {
    "QwenImageTransformerBlock.forward": "8177c846de52aa4e",
    "QwenImageTransformerBlock._modulate": "790253f78c1c2199",
    "AdaLayerNorm.forward_native": "bfc59b1498c56a60",
    "AdaLayerNorm.forward_cuda": "22177f92ea028df7",
    "AdaLayerNorm.forward_hip": "f9d2d32dd4f4243a",
    "AdaLayerNorm.forward_npu": "ec9099f9e734847b",
    "AdaLayerNormContinuous.forward": "9cc655ba4fb2bfec",
    "split_select01_mod_params": "e8a80c7ad2a79e31",
    "select01_modulation_native": "3f26039abc062cb2",
    "ModulateIndexPrepare.forward": "b4795fc261a07196",
}

# How an AdaLayerNorm instance applies (scale, shift); decided in one place: _norm_kind().
_NATIVE = "native"  # layernorm(x) * (1 + scale) + shift, with the instance's own LayerNorm
_NPU_EVAL = "npu_eval"  # torch_npu.npu_layer_norm_eval(x, ...) * (1 + scale) + shift
_OPAQUE = "opaque"  # anything else (MindIE-SD fused kernel, patched instance): call norm(x, scale, shift)


def budget_from_env() -> int:
    """The memo's byte budget from ``VLLM_OMNI_ASCEND_OPT_MODULATION_CACHE_MB`` (MiB, default 512)."""
    raw = os.environ.get(ENV_BUDGET_MB, "").strip()
    if not raw:
        return DEFAULT_BUDGET_MB * 1024**2
    mb = float(raw)  # ValueError for junk; reasons_inactive() reports it
    if not 0 <= mb < float("inf"):  # also rejects NaN
        raise ValueError(f"{ENV_BUDGET_MB}={raw!r} must be a non-negative number of MiB")
    return int(mb * 1024**2)


def _fingerprint(fn: Any) -> str:
    try:
        src = textwrap.dedent(inspect.getsource(fn))
    except (OSError, TypeError):
        return "source unavailable"
    return hashlib.sha256(src.encode()).hexdigest()[:16]


def _upstream_functions() -> dict[str, Any]:
    t = sys.modules[_targets.TRANSFORMER]
    ada = sys.modules[ADALAYERNORM_MODULE].AdaLayerNorm
    return {
        "QwenImageTransformerBlock.forward": _unpatched(t.QwenImageTransformerBlock, "forward"),
        "QwenImageTransformerBlock._modulate": t.QwenImageTransformerBlock._modulate,
        "AdaLayerNorm.forward_native": ada.forward_native,
        "AdaLayerNorm.forward_cuda": ada.forward_cuda,
        "AdaLayerNorm.forward_hip": ada.forward_hip,
        "AdaLayerNorm.forward_npu": ada.forward_npu,
        "AdaLayerNormContinuous.forward": t.AdaLayerNormContinuous.forward,
        "split_select01_mod_params": sys.modules[SELECT01_MODULE].split_select01_mod_params,
        "select01_modulation_native": sys.modules[SELECT01_MODULE].select01_modulation_native,
        "ModulateIndexPrepare.forward": t.ModulateIndexPrepare.forward,
    }


def _unpatched(cls: type, name: str) -> Any:
    fn = cls.__dict__[name]
    return getattr(fn, "__wrapped__", fn)


class _Unkeyable(Exception):
    """This call cannot be memoized safely; the message says why (reported as a fallback reason)."""


# ----------------------------------------------------------------------------------------------------------------
# keys and signatures
# ----------------------------------------------------------------------------------------------------------------
def _numerical_settings(device_type: str) -> tuple[Any, ...]:
    """Process state that can change what the projection computes for the same inputs and weights."""
    npu_matmul = getattr(getattr(torch, "npu", None), "matmul", None)
    return (
        torch.is_grad_enabled(),  # vLLM-Omni's LoRA apply() takes a different (out=) path without grad
        torch.get_float32_matmul_precision(),
        torch.is_autocast_enabled(device_type),
        torch.get_autocast_dtype(device_type),
        torch.backends.cuda.matmul.allow_tf32,
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction,
        torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction,
        getattr(npu_matmul, "allow_hf32", None),
    )


class _Upstream:
    """The upstream classes and functions the checks compare against, looked up once."""

    def __init__(self) -> None:
        t = sys.modules[_targets.TRANSFORMER]
        self.ada_module = sys.modules[ADALAYERNORM_MODULE]
        self.ada = self.ada_module.AdaLayerNorm
        self.custom_op_forward = sys.modules[CUSTOM_OP_MODULE].CustomOp.forward
        self.native = (self.ada.forward_native, self.ada.forward_cuda, self.ada.forward_hip)  # cuda/hip -> native
        self.replicated = t.ReplicatedLinear


_UP: list[_Upstream] = []


def _up() -> _Upstream:
    if not _UP:
        _UP.append(_Upstream())
    return _UP[0]


@dataclass(frozen=True, slots=True)
class _Span:
    """The memory a digested contiguous temb covered; holds its storage so the address cannot be reused."""

    storage: Any
    dtype: torch.dtype
    offset: int
    numel: int

    @staticmethod
    def of(t: torch.Tensor) -> _Span | None:
        return _Span(t.untyped_storage(), t.dtype, t.storage_offset(), t.numel()) if t.is_contiguous() else None

    def contains(self, a: torch.Tensor) -> bool:
        """``a`` only reads this span's memory (same storage and dtype): its values are then fixed by the digested
        values and ``a``'s geometry."""
        if a.dtype != self.dtype or a.untyped_storage().data_ptr() != self.storage.data_ptr():
            return False
        if a.numel() == 0 or any(st < 0 for st in a.stride()):
            return False
        last = a.storage_offset() + sum((n - 1) * st for n, st in zip(a.shape, a.stride(), strict=True))
        return self.offset <= a.storage_offset() and last < self.offset + self.numel


def _hooked(m: nn.Module) -> bool:
    return bool(m._forward_hooks or m._forward_pre_hooks)


def _global_hooks() -> bool:
    return bool(_torch_module._global_forward_hooks or _torch_module._global_forward_pre_hooks)


def _linear_sig(lin: nn.Module, grad: bool) -> tuple[Any, ...]:
    """What a linear's output depends on besides its input: weights (identity, storage, version, layout),
    quantization method and vLLM LoRA state. Only replicated projections (no collective inside, identical on every
    rank): vLLM's ReplicatedLinear, plain or LoRA-wrapped. Kept cheap: it runs for every block of every forward."""
    d = lin.__dict__
    if not isinstance(lin, _up().replicated) and not any(
        c.__name__ == "ReplicatedLinearWithLoRA" for c in type(lin).__mro__
    ):
        raise _Unkeyable(f"modulation projection is a {type(lin).__name__}, not a ReplicatedLinear")
    if lin._modules or lin._buffers or "lora_a_stacked" in d:  # LoRA wrapper, quantized layer: the general walk
        tensors = [*lin.parameters(), *lin.buffers()]
        for name in ("lora_a_stacked", "lora_b_stacked"):
            tensors.extend(t for t in d.get(name, ()) if isinstance(t, torch.Tensor))
        quant = getattr(lin, "quant_method", None)
    else:
        tensors = [t for t in lin._parameters.values() if t is not None]
        quant = d.get("quant_method")
    sig: list[Any] = [id(lin), id(quant), d.get("_diffusion_lora_active_slices")]
    for t in tensors:
        if grad and t.requires_grad:
            raise _Unkeyable("autograd is recording (grad enabled and a modulation weight requires grad)")
        try:
            # vLLM's parameter classes are Tensor subclasses: plain attribute reads would go through
            # __torch_function__ (~1 us each); these reads are metadata only.
            with torch._C.DisableTorchFunctionSubclass():
                sig.append((id(t), t.data_ptr(), t._version, t.shape, t.dtype, t.device))
        except RuntimeError as exc:
            if t.is_inference():
                raise _Unkeyable(
                    "modulation weights are inference tensors (no version counter to detect in-place updates); "
                    "load or cast them under torch.no_grad(), not torch.inference_mode()"
                ) from None
            raise _Unkeyable(f"cannot read a modulation weight's storage ({type(t).__name__}: {exc})") from None
    return tuple(sig)


def _norm_out_linear(norm: nn.Module, grad: bool) -> tuple[Any, ...]:
    """The weight signature of ``norm_out``'s linear; raises :class:`_Unkeyable` when it is not stock's SiLU/linear."""
    if type(norm.silu) is not nn.SiLU or norm.silu.inplace or _hooked(norm.silu) or _hooked(norm.linear):
        raise _Unkeyable("norm_out's SiLU/linear is not stock's (or has hooks)")
    return _linear_sig(norm.linear, grad)


def _silu_linear(seq: nn.Module) -> nn.Module:
    """The linear of stock's ``nn.Sequential(nn.SiLU(), <replicated linear>)``; raises if ``seq`` is not that, or
    carries forward hooks (skipping the module on a hit would skip the hook)."""
    mods = seq._modules
    if not isinstance(seq, nn.Sequential) or len(mods) != 2:
        raise _Unkeyable("modulation module is not nn.Sequential(SiLU, Linear)")
    act, lin = mods.values()
    if type(act) is not nn.SiLU or act.inplace:
        raise _Unkeyable("modulation activation is not an out-of-place nn.SiLU")
    if _hooked(seq) or _hooked(act) or _hooked(lin) or (lin._modules and any(_hooked(m) for m in lin.modules())):
        raise _Unkeyable("forward hooks on a modulation module (skipping it would skip the hook)")
    return lin


def _norm_kind(norm: nn.Module) -> str:
    """How ``norm`` (vLLM-Omni's AdaLayerNorm) applies (scale, shift) -- the one place that looks at the backend."""
    up = _up()
    if type(norm) is not up.ada or _hooked(norm) or up.ada.forward is not up.custom_op_forward:
        return _OPAQUE
    fn = getattr(norm.__dict__.get("_forward_method"), "__func__", None)
    if fn in up.native:
        return _NATIVE
    if fn is up.ada.forward_npu and not getattr(up.ada_module, "_HAS_MINDIESD", True) and _backend.torch_npu_module():
        return _NPU_EVAL
    return _OPAQUE


# ----------------------------------------------------------------------------------------------------------------
# the fast tier: close-tier modes of the memoized block body (opts/fast_modulate.py, opts/fast_residual.py)
# ----------------------------------------------------------------------------------------------------------------
class FastModes:
    """Switches of the fast tier (``close``, off by default), read by the block body on every call; each is turned
    on by its own optimization's ``install`` (``fast_modulate``, ``fast_residual``). ``stats[mode]`` counts the
    calls that took the fast path, ``fallbacks[mode]`` the ones that did not and why."""

    MODES = ("modulate", "residual")

    def __init__(self) -> None:
        self.modulate = False
        self.residual = False
        self.stats: Counter[str] = Counter()
        self.fallbacks: dict[str, Counter[str]] = {m: Counter() for m in self.MODES}

    def set(self, mode: str, on: bool) -> None:
        if mode not in self.MODES:
            raise ValueError(f"unknown fast mode {mode!r}")
        setattr(self, mode, bool(on))

    def ran(self, mode: str) -> None:
        self.stats[mode] += 1

    def fallback(self, mode: str, why: str) -> None:
        self.fallbacks[mode][why] += 1

    def reset(self, mode: str) -> None:
        self.stats[mode] = 0
        self.fallbacks[mode].clear()

    def use_residual(self, x: torch.Tensor, gate: torch.Tensor, y: torch.Tensor) -> bool:
        """Whether a gated residual ``x + gate * y`` runs as ``addcmul`` (counted either way when the mode is on)."""
        if not self.residual:
            return False
        if not (x.dtype == gate.dtype == y.dtype):
            self.fallback("residual", "mixed dtypes in the gated residual (stock promotes; addcmul would not)")
            return False
        self.ran("residual")
        return True


FAST = FastModes()


# ----------------------------------------------------------------------------------------------------------------
# the memo
# ----------------------------------------------------------------------------------------------------------------
@dataclass(slots=True)
class NormMod:
    """One AdaLayerNorm's modulation, unpacked: ``first`` is ``1 + scale`` (kinds native/npu_eval) or ``scale``."""

    first: torch.Tensor
    shift: torch.Tensor
    gate: torch.Tensor
    kind: str
    #: fast_modulate: the ``[D]`` affine ``(1 + scale, shift)`` of every token (views of ``first``/``shift``), or why
    #: this norm cannot take them; built on first fast use and kept with the memo entry (a warm step pays no op).
    affine: tuple[torch.Tensor, torch.Tensor] | str | None = None

    def norm(self, norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """``norm(x, scale, shift)``, computed with the same ops as the instance's stock dispatch (or, with
        ``fast_modulate``, as one affine layer norm)."""
        if FAST.modulate:
            if self.affine is None:
                self.affine = _affine_params(self, norm)
            why = self.affine if isinstance(self.affine, str) else _affine_dtype_reason(x, self.affine[0])
            if why is None:
                FAST.ran("modulate")
                return _affine_layernorm(self.kind, norm, x, *self.affine)
            FAST.fallback("modulate", why)
        if self.kind == _NATIVE:
            return norm.layernorm(x) * self.first + self.shift
        if self.kind == _NPU_EVAL:
            torch_npu = _backend.torch_npu_module()
            return (
                torch_npu.npu_layer_norm_eval(x, normalized_shape=[norm.hidden_size], eps=norm.eps) * self.first
                + self.shift
            )
        return norm(x, self.first, self.shift)

    def gated(self, y: torch.Tensor) -> torch.Tensor:
        """Stock's gated residual term ``gate * y`` (the interface :class:`SegMod` shares)."""
        return self.gate * y

    def residual(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Stock's ``x + gate * y``; with ``fast_residual`` one ``torch.addcmul(x, gate, y)``."""
        if FAST.use_residual(x, self.gate, y):
            return torch.addcmul(x, self.gate, y)
        return x + self.gate * y

    @staticmethod
    def unpack(scale: torch.Tensor, shift: torch.Tensor, gate: torch.Tensor, kind: str) -> NormMod:
        own = torch.contiguous_format
        first = (1 + scale) if kind in (_NATIVE, _NPU_EVAL) else scale.clone(memory_format=own)
        return NormMod(first, shift.clone(memory_format=own), gate.clone(memory_format=own), kind)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.first, self.shift, self.gate))


def _affine_layernorm(
    kind: str, norm: nn.Module, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor
) -> torch.Tensor:
    """fast_modulate: ``LN(x) * (1 + scale) + shift`` as ONE affine layer norm, ``weight = 1 + scale``,
    ``bias = shift`` (``[D]``) -- the one place that picks its kernel: ``npu_layer_norm_eval`` (kind npu_eval,
    [OP-LNE] accepts weight and bias) or ``F.layer_norm`` (native). The affine runs in the kernel's fp32 opmath
    with one rounding instead of stock's three roundings in bf16: close, not exact (1 ulp bf16)."""
    if kind == _NPU_EVAL:
        return _backend.torch_npu_module().npu_layer_norm_eval(
            x, normalized_shape=[norm.hidden_size], weight=weight, bias=bias, eps=norm.eps
        )
    ln = norm.layernorm
    return F.layer_norm(x, ln.normalized_shape, weight, bias, ln.eps)


def _affine_params(mod: NormMod, norm: nn.Module) -> tuple[torch.Tensor, torch.Tensor] | str:
    """``(1 + scale, shift)`` as ``[D]`` views when every token of every sample shares them, else why not."""
    if mod.kind not in (_NATIVE, _NPU_EVAL):
        return "AdaLayerNorm is not stock's native / torch_npu path (MindIE-SD fused kernel or a patched instance)"
    ln = norm.layernorm
    if ln.weight is not None or ln.bias is not None:
        return "the AdaLayerNorm's LayerNorm has its own affine weights"
    if mod.kind == _NATIVE and _hooked(ln):
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


def _layernorm(kind: str, norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The normalisation half of ``AdaLayerNorm`` for kinds native / npu_eval (what stock multiplies by 1+scale)."""
    if kind == _NPU_EVAL:
        return _backend.torch_npu_module().npu_layer_norm_eval(x, normalized_shape=[norm.hidden_size], eps=norm.eps)
    return norm.layernorm(x)


@dataclass(frozen=True, slots=True)
class SegmentPlan:
    """Where stock's ``select01_modulation_native`` picks segment 0 or 1 along the (local) image sequence.

    ``runs``: ``(start, end, segment)`` of equal ``modulate_index != 0`` values (identical in every batch row).
    With ``chunks`` (``L / gcd(run lengths)``) at most :data:`MAX_BROADCAST_CHUNKS`, the sequence is viewed as
    ``[B, chunks, L / chunks, D]`` and each chunk's segment tensor broadcasts over it (one op per multiply/add);
    otherwise each run is computed on its slice."""

    length: int
    runs: tuple[tuple[int, int, int], ...]
    chunk: int  # tokens per chunk (gcd of the run lengths)

    @property
    def chunks(self) -> int:
        return self.length // self.chunk

    @property
    def broadcast(self) -> bool:
        return self.chunks <= MAX_BROADCAST_CHUNKS

    def chunk_segments(self) -> list[int]:
        return [seg for start, end, seg in self.runs for _ in range((end - start) // self.chunk)]

    @staticmethod
    def of(index: torch.Tensor) -> SegmentPlan:
        """The plan of a ``[rows, L]`` modulate_index (one device->host copy); ValueError when rows differ."""
        if index.dim() != 2 or index.shape[1] == 0:
            raise ValueError(f"modulate_index of shape {tuple(index.shape)} is not [rows, L]")
        rows = index.tolist()  # one device->host copy, no kernel on the device
        if any(row != rows[0] for row in rows[1:]):
            raise ValueError("modulate_index differs between batch rows")
        values = [v != 0 for v in rows[0]]  # stock: index.to(dtype=torch.bool)
        runs: list[tuple[int, int, int]] = []
        start = 0
        for i in range(1, len(values) + 1):
            if i == len(values) or values[i] != values[start]:
                runs.append((start, i, int(values[start])))
                start = i
        chunk = 0
        for a, b, _ in runs:
            chunk = math.gcd(chunk, b - a)
        return SegmentPlan(len(values), tuple(runs), chunk)


@dataclass(slots=True)
class SegMod:
    """One two-segment AdaLayerNorm's modulation (image stream of a ``zero_cond_t`` block), unpacked.

    Broadcast plans: ``first``/``shift``/``gate`` are ``[B, chunks, 1, D]`` (each chunk's segment row, copied);
    slice plans: tuples indexed by segment of ``[B, 1, D]`` tensors. ``first`` is ``1 + scale``. Every product and
    sum below is the elementwise op stock runs on the same two values, so the result is stock's bit for bit."""

    first: Any
    shift: Any
    gate: Any
    kind: str
    plan: SegmentPlan

    def _apply(self, y: torch.Tensor, mul: Any, add: Any | None) -> torch.Tensor:
        plan = self.plan
        b, n, d = y.shape
        if plan.broadcast:
            out = y.reshape(b, plan.chunks, plan.chunk, d) * mul
            if add is not None:
                out = out + add
            return out.view(b, n, d)
        out = torch.empty(y.shape, dtype=torch.promote_types(y.dtype, mul[0].dtype), device=y.device)
        for start, end, seg in plan.runs:
            part = out[:, start:end]
            torch.mul(y[:, start:end], mul[seg], out=part)
            if add is not None:
                part.add_(add[seg])
        return out

    def norm(self, norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """Stock: ``norm(x, where(idx, scale1, scale0), where(idx, shift1, shift0))``."""
        if FAST.modulate:
            FAST.fallback("modulate", "two-segment image norm (zero_cond_t): the modulation differs between segments")
        return self._apply(_layernorm(self.kind, norm, x), self.first, self.shift)

    def gated(self, y: torch.Tensor) -> torch.Tensor:
        """Stock: ``where(idx, gate1, gate0) * y``."""
        return self._apply(y, self.gate, None)

    def residual(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Stock's ``x + where(idx, gate1, gate0) * y``; with ``fast_residual`` one ``addcmul`` per broadcast or
        per segment slice."""
        gate = self.gate if self.plan.broadcast else self.gate[0]
        if not FAST.use_residual(x, gate, y):
            return x + self.gated(y)
        plan = self.plan
        b, n, d = y.shape
        if plan.broadcast:
            shape = (b, plan.chunks, plan.chunk, d)
            return torch.addcmul(x.reshape(shape), self.gate, y.reshape(shape)).view(b, n, d)
        out = torch.empty(y.shape, dtype=y.dtype, device=y.device)
        for start, end, seg in plan.runs:
            torch.addcmul(x[:, start:end], self.gate[seg], y[:, start:end], out=out[:, start:end])
        return out

    @staticmethod
    def segment(scale: torch.Tensor, shift: torch.Tensor, gate: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """One segment's ``(1 + scale, shift, gate)`` as contiguous ``[B, 1, D]`` tensors, from stock's
        ``split_select01_mod_params`` halves (``[B, D]`` views of the projection)."""
        own = torch.contiguous_format
        return ((1 + scale).unsqueeze(1), shift.unsqueeze(1).clone(memory_format=own), gate.unsqueeze(1).clone())

    @staticmethod
    def build(per_seg: tuple[tuple[torch.Tensor, ...], ...], kind: str, plan: SegmentPlan) -> SegMod:
        """``per_seg[k]`` is :meth:`segment` of segment ``k`` (0: current timestep, 1: timestep 0)."""
        if plan.broadcast:
            order = plan.chunk_segments()
            first, shift, gate = (torch.stack([per_seg[k][j] for k in order], dim=1) for j in range(3))
            return SegMod(first, shift, gate, kind, plan)
        first, shift, gate = (tuple(per_seg[k][j] for k in (0, 1)) for j in range(3))
        return SegMod(first, shift, gate, kind, plan)

    def nbytes(self, segment: int | None = None) -> int:
        """Bytes held; for slice plans ``segment`` counts only that segment's tensors."""
        if self.plan.broadcast:
            return sum(t.numel() * t.element_size() for t in (self.first, self.shift, self.gate))
        segs = (0, 1) if segment is None else (segment,)
        return sum(x[k].numel() * x[k].element_size() for x in (self.first, self.shift, self.gate) for k in segs)


@dataclass(slots=True)
class _Slot:
    module: weakref.ReferenceType
    sig: tuple[Any, ...]
    payload: Any
    nbytes: int


@dataclass
class _Entry:
    key: tuple[Any, ...]
    silu: torch.Tensor | None = None
    slots: dict[tuple[Any, ...], _Slot] = field(default_factory=dict)
    nbytes: int = 0


class ModulationMemo:
    """Exact, byte-bounded LRU memo of modulation tensors keyed on the temb value and the weights.

    Entries (one per distinct temb value and numerical settings) hold slots (one per block / direct projection /
    ``norm_out``). A slot is reused only while its module is alive and its weight signature is unchanged; every
    payload is what stock's code computes from the same inputs, so a hit is bitwise stock's result.
    """

    def __init__(self, max_bytes: int = DEFAULT_BUDGET_MB * 1024**2) -> None:
        self.max_bytes = max_bytes
        self._entries: OrderedDict[tuple[Any, ...], _Entry] = OrderedDict()
        self._bytes = 0
        # (the last digested temb, its version, its entry, its _Span or None when not contiguous)
        self._last: tuple[weakref.ReferenceType, int | None, _Entry, _Span | None] | None = None
        self.stats: Counter[str] = Counter()
        # Two-segment blocks: the timestep-0 segment per (block, weights, settings), for the model's life.
        self._zero_t: dict[tuple[Any, ...], tuple[weakref.ReferenceType, torch.Tensor, tuple[Any, ...]]] = {}
        self._plan: tuple[weakref.ReferenceType, int | None, SegmentPlan | str] | None = None

    # ----- bookkeeping ------------------------------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        self._entries.clear()
        self._bytes = 0
        self._last = None
        self._zero_t.clear()
        self._plan = None

    @property
    def zero_t_nbytes(self) -> int:
        """Bytes of the timestep-0 segments (outside the LRU budget: one per block and weights)."""
        return sum(
            raw.numel() * raw.element_size() + sum(t.numel() * t.element_size() for seg in segs for t in seg)
            for _ref, raw, segs in self._zero_t.values()
        )

    def configure(self, max_bytes: int) -> None:
        self.max_bytes = int(max_bytes)
        self._evict(keep=None)

    def _evict(self, keep: _Entry | None, need: int = 0) -> None:
        """Drop least-recently-used entries (never ``keep``) until ``need`` more bytes fit in the budget."""
        while self._bytes + need > self.max_bytes and self._entries:
            key = next(iter(self._entries))
            victim = self._entries[key]
            if victim is keep:
                if len(self._entries) == 1:
                    break
                self._entries.move_to_end(key)
                continue
            del self._entries[key]
            self._bytes -= victim.nbytes
            self.stats["evictions"] += 1
            if self._last is not None and self._last[2] is victim:
                self._last = None

    def _store(self, entry: _Entry, key: tuple[Any, ...], module: nn.Module, sig: Any, payload: Any, nb: int) -> None:
        if self._entries.get(entry.key) is not entry:
            return  # evicted meanwhile (its bytes are already released)
        old = entry.slots.pop(key, None)
        if old is not None:
            entry.nbytes -= old.nbytes
            self._bytes -= old.nbytes
        if self._bytes + nb > self.max_bytes:
            self._evict(keep=entry, need=nb)
            if self._bytes + nb > self.max_bytes:
                self.stats["not_stored"] += 1
                return
        entry.slots[key] = _Slot(weakref.ref(module), sig, payload, nb)
        entry.nbytes += nb
        self._bytes += nb

    # ----- lookups ----------------------------------------------------------------------------------------
    def _precheck(self, temb: torch.Tensor) -> str | None:
        if self.max_bytes <= 0:
            return f"modulation memo budget is 0 ({ENV_BUDGET_MB})"
        if torch.compiler.is_compiling():
            return "torch.compile is tracing"
        if torch.is_grad_enabled() and temb.requires_grad:
            return "autograd is recording (temb requires grad)"
        if type(temb) is not torch.Tensor:
            return f"temb is a {type(temb).__name__}, not a plain tensor"
        why = _backend.graph_capture_reason()
        if why:
            return why
        if _global_hooks():
            return "global nn.Module forward hooks are registered"
        return None

    def _resolve(self, temb: torch.Tensor) -> _Entry:
        """The entry for temb's value (one device->host copy + SHA-256 per new temb object)."""
        version = None if temb.is_inference() else temb._version
        last = self._last
        if last is not None and self._entries.get(last[2].key) is last[2] and last[1] == version:
            obj = last[0]()
            if obj is temb:
                entry = last[2]
                self._entries.move_to_end(entry.key)
                return entry
            span = last[3]
            if span is not None and span.contains(temb):
                # A view of the last temb (edit models' ``temb.chunk(2)[0]``, made anew in every block, and the one
                # norm_out gets after the model rebinds ``temb`` to it): its values are fixed by the digested values
                # and the view geometry, so no new digest is needed. Matched by storage, not ``_base`` or the base
                # object: under ``inference_mode`` (vLLM-Omni's runner) views have no ``_base`` and the base may be
                # gone; the span holds the storage, so its memory cannot be reused meanwhile.
                geometry = (temb.dtype, temb.storage_offset() - span.offset, temb.shape, temb.stride())
                return self._entry(("view", last[2].key, geometry))
        from vllm_omni.diffusion.cache.exact_projection_cache import tensor_digest

        self.stats["digests"] += 1
        entry = self._entry((tensor_digest(temb), str(temb.device), _numerical_settings(temb.device.type)))
        self._last = (weakref.ref(temb), version, entry, _Span.of(temb))
        return entry

    def _entry(self, key: tuple[Any, ...]) -> _Entry:
        entry = self._entries.get(key)
        if entry is None:
            entry = _Entry(key)
            self._entries[key] = entry
        else:
            self._entries.move_to_end(key)
        return entry

    def _silu(self, entry: _Entry, temb: torch.Tensor) -> torch.Tensor:
        """SiLU(temb), once per entry (stock: nn.SiLU() -> F.silu(temb, inplace=False))."""
        if entry.silu is None:
            self.stats["silu"] += 1
            entry.silu = F.silu(temb)
            nb = entry.silu.numel() * entry.silu.element_size()
            entry.nbytes += nb
            self._bytes += nb
        return entry.silu

    @staticmethod
    def _lookup(entry: _Entry, key: tuple[Any, ...], module: nn.Module, sig: Any) -> Any:
        slot = entry.slots.get(key)
        if slot is not None and slot.module() is module and slot.sig == sig:
            return slot.payload
        return None

    def _projection(self, entry: _Entry, seq: nn.Module, lin: nn.Module, sig: Any, temb: torch.Tensor) -> torch.Tensor:
        """``seq(temb)`` for a ``Sequential(SiLU, Linear)``: reuse a stored direct-call result, else replay."""
        raw = self._lookup(entry, ("raw", id(seq)), seq, sig)
        if raw is not None:
            return raw
        self.stats["projections"] += 1
        return lin(self._silu(entry, temb))

    def direct_projection(self, seq: nn.Module, temb: torch.Tensor) -> tuple[torch.Tensor | None, str | None]:
        """``seq(temb)`` for direct calls of ``img_mod``/``txt_mod`` (TeaCache's probe). (result, fallback reason)."""
        why = self._precheck(temb)
        if why:
            return None, why
        try:
            lin = _silu_linear(seq)
            sig = _linear_sig(lin, torch.is_grad_enabled())
        except _Unkeyable as exc:
            return None, str(exc)
        entry = self._resolve(temb)
        key = ("raw", id(seq))
        raw = self._lookup(entry, key, seq, sig)
        if raw is not None:
            self.stats["hits"] += 1
            return raw, None
        self.stats["misses"] += 1
        self.stats["projections"] += 1
        raw = lin(self._silu(entry, temb))
        self._store(entry, key, seq, sig, raw, raw.numel() * raw.element_size())
        return raw, None

    def block(self, block: nn.Module, temb: torch.Tensor) -> tuple[tuple[NormMod, ...] | None, str | None]:
        """The four unpacked modulations (img1, img2, txt1, txt2) of ``block`` for ``temb``, or a fallback reason."""
        why = self._precheck(temb)
        if why:
            return None, why
        try:
            img_lin, txt_lin, kinds, sig_img, sig_txt = _block_parts(block)
        except _Unkeyable as exc:
            return None, str(exc)
        sig = (sig_img, sig_txt, kinds)
        entry = self._resolve(temb)
        key = ("block", id(block))
        mods = self._lookup(entry, key, block, sig)
        if mods is not None:
            self.stats["hits"] += 1
            return mods, None
        self.stats["misses"] += 1
        # Replay of stock: img_mod(temb), txt_mod(temb), chunk(2), _modulate -> (scale, shift, gate) views.
        img_params = self._projection(entry, block.img_mod, img_lin, sig_img, temb)
        txt_params = self._projection(entry, block.txt_mod, txt_lin, sig_txt, temb)
        img_mod1, img_mod2 = img_params.chunk(2, dim=-1)
        txt_mod1, txt_mod2 = txt_params.chunk(2, dim=-1)
        mods = tuple(
            NormMod.unpack(*block._modulate(p), kind)
            for p, kind in zip((img_mod1, img_mod2, txt_mod1, txt_mod2), kinds, strict=True)
        )
        self._store(entry, key, block, sig, mods, sum(m.nbytes() for m in mods))
        return mods, None

    # ----- two-segment (zero_cond_t) blocks ------------------------------------------------------------------
    def segment_plan(self, index: torch.Tensor) -> tuple[SegmentPlan | None, str | None]:
        """The :class:`SegmentPlan` of ``modulate_index``: computed once per index tensor (vLLM-Omni makes one per
        transformer forward and hands the same object to every block), one device->host copy."""
        version = None if index.is_inference() else index._version
        cached = self._plan
        if cached is not None and cached[0]() is index and cached[1] == version:
            plan = cached[2]
        else:
            self.stats["plans"] += 1
            try:
                plan = SegmentPlan.of(index)
            except ValueError as exc:
                plan = str(exc)
            self._plan = (weakref.ref(index), version, plan)
        return (plan, None) if isinstance(plan, SegmentPlan) else (None, plan)

    def _zero_t_segments(
        self, block: nn.Module, sig: Any, raw: torch.Tensor, halves: tuple[Any, ...]
    ) -> tuple[tuple[torch.Tensor, ...], ...]:
        """Segment 1 (timestep 0) of ``block``'s two image norms, kept once per block and weights signature.

        ``raw`` is this forward's timestep-0 rows of ``img_mod(temb)`` (stock's 2B-row projection) and ``halves``
        its ``(scale1, shift1, gate1)`` per norm. The stored segments are reused only while they equal ``raw``
        bit for bit (one comparison per miss): a 2B-row GEMM computes each row from that row alone, so they do
        for fixed weights, batch, dtype and settings -- ``zero_t_mismatch`` would count the contrary."""
        key = ("zero_t", id(block), sig, raw.shape, raw.dtype, str(raw.device), _numerical_settings(raw.device.type))
        stored = self._zero_t.get(key)
        if stored is not None and stored[0]() is block:
            if torch.equal(stored[1], raw):
                self.stats["zero_t_hits"] += 1
                return stored[2]
            self.stats["zero_t_mismatch"] += 1
        self.stats["zero_t_misses"] += 1
        segs = tuple(SegMod.segment(*h) for h in halves)
        for k in [k for k, v in self._zero_t.items() if v[0]() is None or (k[1] == id(block) and k != key)]:
            del self._zero_t[k]  # dead blocks and this block's older weights / settings
        self._zero_t[key] = (weakref.ref(block), raw.clone(), segs)
        return segs

    def block_two_segment(
        self, block: nn.Module, temb: torch.Tensor, index: torch.Tensor, hidden_states: torch.Tensor
    ) -> tuple[tuple[Any, ...] | None, str | None]:
        """``(SegMod img1, SegMod img2, NormMod txt1, NormMod txt2)`` of a ``zero_cond_t`` block, or a reason.

        Replays stock exactly on a miss: ``img_mod(temb)`` on all 2B rows (``[t, 0]`` embeddings), ``txt_mod`` on
        ``temb.chunk(2)[0]``, ``split_select01_mod_params`` per image norm."""
        why = self._precheck(temb)
        if why:
            return None, why
        sel = sys.modules[SELECT01_MODULE]
        if sys.modules[_targets.TRANSFORMER].can_use_qwen_select01_triton(hidden_states):  # the block's own test
            return None, "the fused Triton select01 kernels are the stock path here (CUDA)"
        batch = hidden_states.shape[0]
        if temb.dim() != 2 or temb.shape[0] != 2 * batch or index.shape[0] not in (1, batch):
            return None, "two-segment modulation with an unexpected temb / modulate_index batch"
        if index.shape[-1] != hidden_states.shape[1]:
            return None, "modulate_index does not match the image sequence"
        try:
            img_lin, txt_lin, kinds, sig_img, sig_txt = _block_parts(block)
        except _Unkeyable as exc:
            return None, str(exc)
        if _OPAQUE in kinds[:2]:
            return None, "a fused (MindIE-SD) image AdaLayerNorm takes per-token scale tensors"
        plan, why = self.segment_plan(index)
        if plan is None:
            return None, why
        sig = (sig_img, sig_txt, kinds)
        entry = self._resolve(temb)
        key = ("block2", id(block), plan, hidden_states.dtype)
        mods = self._lookup(entry, key, block, sig)
        if mods is not None:
            self.stats["hits"] += 1
            return mods, None
        self.stats["misses"] += 1
        # Replay of stock: img_mod(temb) (2B rows), txt_mod(temb.chunk(2, dim=0)[0]), chunk(2), select01 halves.
        img_params = self._projection(entry, block.img_mod, img_lin, sig_img, temb)
        temb_txt = torch.chunk(temb, 2, dim=0)[0]
        txt_params = self._projection(self._resolve(temb_txt), block.txt_mod, txt_lin, sig_txt, temb_txt)
        img_mods = img_params.chunk(2, dim=-1)
        splits = [sel.split_select01_mod_params(m) for m in img_mods]  # (scale0, shift0, gate0, scale1, ...)
        zero = self._zero_t_segments(block, (sig_img, kinds[:2]), img_params[batch:], tuple(sp[3:] for sp in splits))
        img = tuple(
            SegMod.build((SegMod.segment(*sp[:3]), z), kind, plan)
            for sp, z, kind in zip(splits, zero, kinds[:2], strict=True)
        )
        txt = tuple(
            NormMod.unpack(*block._modulate(p), kind)
            for p, kind in zip(txt_params.chunk(2, dim=-1), kinds[2:], strict=True)
        )
        mods = (*img, *txt)
        nb = sum(m.nbytes(0) for m in img) + sum(m.nbytes() for m in txt)
        self._store(entry, key, block, sig, mods, nb)
        return mods, None

    def norm_out(self, norm: nn.Module, x: torch.Tensor, cond: torch.Tensor) -> tuple[Any, str | None]:
        """``((1 + scale)[:, None, :], shift[:, None, :])`` of diffusers' AdaLayerNormContinuous, or a reason."""
        why = self._precheck(cond)
        if why:
            return None, why
        try:
            sig = _norm_out_linear(norm, torch.is_grad_enabled())
        except _Unkeyable as exc:
            return None, str(exc)
        entry = self._resolve(cond)
        key = ("norm_out", id(norm), x.dtype)
        mods = self._lookup(entry, key, norm, sig)
        if mods is not None:
            self.stats["hits"] += 1
            return mods, None
        self.stats["misses"] += 1
        self.stats["projections"] += 1
        # Replay of diffusers 0.40 AdaLayerNormContinuous.forward up to the norm.
        emb = norm.linear(self._silu(entry, cond).to(x.dtype))
        scale, shift = torch.chunk(emb, 2, dim=1)
        mods = ((1 + scale)[:, None, :], shift[:, None, :].clone(memory_format=torch.contiguous_format))
        self._store(entry, key, norm, sig, mods, sum(t.numel() * t.element_size() for t in mods))
        return mods, None


# ----------------------------------------------------------------------------------------------------------------
# the optimization
# ----------------------------------------------------------------------------------------------------------------
class SharedModulation(Optimization):
    name = "shared_modulation"
    summary = "Compute SiLU(temb) and the per-block modulation projections once per distinct timestep embedding (exact memo), and unpack them once per block into broadcast-ready tensors."
    equivalence = "exact"
    default_enabled = True
    requires = ("vLLM-Omni 0.30.x; any device and dtype",)
    target_modules = (_targets.TRANSFORMER,)
    parallel_support = dict.fromkeys(PARALLEL_MODES, "supported")  # per-rank memo, no collectives (see docstring)
    regions = frozenset({"block", "transformer"})  # the block body and projections; norm_out in the forward
    removal_plan = "Drop once vLLM-Omni memoizes Qwen-Image's modulation (upstream ExactProjectionCache wiring)."

    def __init__(self) -> None:
        super().__init__()
        self.memo = ModulationMemo()
        self.stats = self.memo.stats  # the memo counts hits, misses, digests... for this optimization
        self._original_norm_out_forward: Any = None
        self._swapped: weakref.WeakKeyDictionary[nn.Module, type] = weakref.WeakKeyDictionary()
        self._classes: dict[str, type] = {}

    # ----- reasons ----------------------------------------------------------------------------------------
    def _process_reasons(self) -> list[str]:
        reasons = []
        try:
            budget_from_env()
        except ValueError as exc:
            reasons.append(f"{ENV_BUDGET_MB} is invalid ({exc})")
        if all(m in sys.modules for m in (_targets.TRANSFORMER, ADALAYERNORM_MODULE, SELECT01_MODULE)):
            for name, fn in _upstream_functions().items():
                got = _fingerprint(fn)
                if got != FINGERPRINTS[name]:
                    reasons.append(
                        f"upstream {name} differs from the vLLM-Omni 0.30.0 code this patch mirrors "
                        f"(source fingerprint {got}, expected {FINGERPRINTS[name]})"
                    )
        return reasons

    def _model_reasons(self, model: nn.Module) -> list[str]:
        transformers = _find_transformers(model)
        if not transformers:
            return ["no Qwen-Image transformer in this model"]
        reasons = []
        if self.memo.max_bytes <= 0:
            reasons.append(f"modulation memo budget is 0 ({ENV_BUDGET_MB})")
        for tr in transformers:
            # The very checks the memo makes per call (keyability of every projection), not a guess from the
            # weights between forwards (under layerwise offload they are placeholders then).
            reasons += unkeyable_reasons(tr)
        return list(dict.fromkeys(reasons))

    def model_notes(self, model: nn.Module) -> list[str]:
        return [why for tr in _find_transformers(model) if (why := block_body_reason(tr))]

    def cache_memory(self) -> dict[str, Any]:
        return {
            "bytes": int(self.memo.nbytes),
            "budget_bytes": int(self.memo.max_bytes),
            "entries": len(self.memo),
            "evictions": int(self.memo.stats.get("evictions", 0)),
        }

    def notes(self) -> list[str]:
        s = self.memo.stats
        return [
            f"memo budget {self.memo.max_bytes / 1024**2:.0f} MiB ({ENV_BUDGET_MB}); "
            f"{len(self.memo)} temb entries, {self.memo.nbytes / 1024**2:.1f} MiB; "
            f"hits {s['hits']}, misses {s['misses']}, evictions {s['evictions']}"
        ]

    def invalidate(self) -> None:
        """Drop every memoized tensor: call after writing modulation weights in a way version counters cannot see
        (``param.data`` writes other than ``load_weights``, which invalidates by itself)."""
        self.memo.clear()

    def weights_changed(self, model: Any = None) -> None:
        """Another optimization rewrote weights behind the version counters (``nz_weights``): drop the memo."""
        self.invalidate()

    # ----- install ----------------------------------------------------------------------------------------
    def _install(self) -> None:
        t = sys.modules[_targets.TRANSFORMER]
        block_cls, model_cls = t.QwenImageTransformerBlock, t.QwenImageTransformer2DModel
        self.memo.configure(budget_from_env())
        self._original_norm_out_forward = t.AdaLayerNormContinuous.forward
        self._make_classes(t)
        original_forward = block_cls.forward
        opt = self

        def forward(
            self,
            hidden_states: torch.Tensor,
            encoder_hidden_states: torch.Tensor,
            encoder_hidden_states_mask: torch.Tensor,
            temb: torch.Tensor,
            image_rotary_emb: tuple[torch.Tensor, torch.Tensor],
            joint_attention_kwargs: dict[str, Any] | None = None,
            modulate_index: list[int] | None = None,
            hidden_states_mask: torch.Tensor | None = None,
        ) -> tuple[torch.Tensor, torch.Tensor]:
            if modulate_index is not None and self.zero_cond_t:
                mods, why = opt.memo.block_two_segment(self, temb, modulate_index, hidden_states)
            elif modulate_index is not None or self.zero_cond_t:
                mods, why = None, "zero_cond_t and modulate_index disagree (stock decides)"
            else:
                mods, why = opt.memo.block(self, temb)
            if mods is None:
                opt._fallback(why or "unknown")
                return original_forward(
                    self,
                    hidden_states=hidden_states,
                    encoder_hidden_states=encoder_hidden_states,
                    encoder_hidden_states_mask=encoder_hidden_states_mask,
                    temb=temb,
                    image_rotary_emb=image_rotary_emb,
                    joint_attention_kwargs=joint_attention_kwargs,
                    modulate_index=modulate_index,
                    hidden_states_mask=hidden_states_mask,
                )
            return _block_body(
                self,
                mods,
                hidden_states,
                encoder_hidden_states,
                encoder_hidden_states_mask,
                image_rotary_emb,
                hidden_states_mask,
            )

        forward.__wrapped__ = original_forward  # type: ignore[attr-defined]
        forward.__doc__ = original_forward.__doc__
        self.patches.set(block_cls, "forward", forward)

        original_load = model_cls.load_weights

        def load_weights(self, weights):
            try:
                return original_load(self, weights)
            finally:
                opt.invalidate()  # default_weight_loader writes through param.data: version counters miss it

        load_weights.__wrapped__ = original_load  # type: ignore[attr-defined]
        self.patches.set(model_cls, "load_weights", load_weights)

    def _make_classes(self, t: Any) -> None:
        if self._classes:
            return
        opt = self
        base_norm = t.AdaLayerNormContinuous

        class MemoModulation(nn.Sequential):
            """Stock ``nn.Sequential(SiLU, ReplicatedLinear)`` whose direct calls are memoized (same object)."""

            def forward(self, input: torch.Tensor) -> torch.Tensor:
                out, why = opt.memo.direct_projection(self, input)
                if out is None:
                    opt._fallback(why or "unknown")
                    return nn.Sequential.forward(self, input)
                return out

        class MemoAdaLayerNormContinuous(base_norm):
            """diffusers' AdaLayerNormContinuous whose ``(1 + scale, shift)`` come from the memo (same object)."""

            def forward(self, x: torch.Tensor, conditioning_embedding: torch.Tensor) -> torch.Tensor:
                mods, why = opt.memo.norm_out(self, x, conditioning_embedding)
                if mods is None:
                    opt._fallback(why or "unknown")
                    return opt._original_norm_out_forward(self, x, conditioning_embedding)
                ops, shift = mods
                return self.norm(x) * ops + shift

        self._classes = {"modulation": MemoModulation, "norm_out": MemoAdaLayerNormContinuous, "norm_base": base_norm}

    def _uninstall(self) -> None:
        for module, cls in list(self._swapped.items()):
            module.__class__ = cls
        self._swapped = weakref.WeakKeyDictionary()
        self.memo.clear()

    # ----- attach -----------------------------------------------------------------------------------------
    def _attach(self, model: nn.Module) -> None:
        for tr in _find_transformers(model):
            for block in tr.transformer_blocks:
                for name in ("img_mod", "txt_mod"):
                    self._swap(getattr(block, name), nn.Sequential, self._classes["modulation"])
            self._swap(tr.norm_out, self._classes["norm_base"], self._classes["norm_out"])

    def _detach(self, model: nn.Module) -> None:
        for tr in _find_transformers(model):
            for m in [*(getattr(b, n) for b in tr.transformer_blocks for n in ("img_mod", "txt_mod")), tr.norm_out]:
                cls = self._swapped.pop(m, None)
                if cls is not None:
                    m.__class__ = cls
        self.memo.clear()

    def _swap(self, module: nn.Module, expected: type, replacement: type) -> None:
        if type(module) is expected and module not in self._swapped:
            self._swapped[module] = expected
            module.__class__ = replacement

    def is_prepared(self, module: nn.Module) -> bool:
        """Whether ``module`` (an img_mod/txt_mod/norm_out) currently carries the memoizing class."""
        return module in self._swapped


def _block_parts(
    block: nn.Module, grad: bool | None = None
) -> tuple[nn.Module, nn.Module, tuple[str, ...], tuple, tuple]:
    """(img linear, txt linear, the four AdaLayerNorm kinds, img weight signature, txt weight signature) of a block:
    what its memo entries are keyed on. Raises :class:`_Unkeyable` when a projection cannot be memoized. ``grad``:
    whether autograd records (default: the current grad mode)."""
    grad = torch.is_grad_enabled() if grad is None else grad
    img_lin = _silu_linear(block.img_mod)
    txt_lin = _silu_linear(block.txt_mod)
    kinds = tuple(_norm_kind(n) for n in (block.img_norm1, block.img_norm2, block.txt_norm1, block.txt_norm2))
    return img_lin, txt_lin, kinds, _linear_sig(img_lin, grad), _linear_sig(txt_lin, grad)


def _block_body(
    block: nn.Module,
    mods: tuple[NormMod, ...],
    hidden_states: torch.Tensor,
    encoder_hidden_states: torch.Tensor,
    encoder_hidden_states_mask: torch.Tensor | None,
    image_rotary_emb: tuple[torch.Tensor, torch.Tensor],
    hidden_states_mask: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM-Omni 0.30's block with its modulation read from ``mods``: the same ops on the same values as
    ``QwenImageTransformerBlock.forward`` (unless a fast-tier mode is on: :data:`FAST`). Single-segment blocks (``modulate_index=None``, image mods are
    :class:`NormMod`) and ``zero_cond_t`` blocks (``select01_modulation_native`` path; image mods are :class:`SegMod`,
    per-segment broadcast instead of three ``torch.where`` over ``[B, L, D]`` per image norm) share this body."""
    img1, img2, txt1, txt2 = mods
    img_modulated = img1.norm(block.img_norm1, hidden_states)
    txt_modulated = txt1.norm(block.txt_norm1, encoder_hidden_states)
    img_attn_output, txt_attn_output = block.attn(
        hidden_states=img_modulated,
        encoder_hidden_states=txt_modulated,
        vid_freqs=image_rotary_emb[0],
        txt_freqs=image_rotary_emb[1],
        hidden_states_mask=hidden_states_mask,
        encoder_hidden_states_mask=encoder_hidden_states_mask,
    )
    hidden_states = img1.residual(hidden_states, img_attn_output)
    encoder_hidden_states = txt1.residual(encoder_hidden_states, txt_attn_output)

    img_modulated2 = img2.norm(block.img_norm2, hidden_states)
    hidden_states = img2.residual(hidden_states, block.img_mlp(img_modulated2))
    txt_modulated2 = txt2.norm(block.txt_norm2, encoder_hidden_states)
    encoder_hidden_states = txt2.residual(encoder_hidden_states, block.txt_mlp(txt_modulated2))

    if encoder_hidden_states.dtype == torch.float16:
        encoder_hidden_states = encoder_hidden_states.clip(-65504, 65504)
    if hidden_states.dtype == torch.float16:
        hidden_states = hidden_states.clip(-65504, 65504)
    return encoder_hidden_states, hidden_states


def _find_transformers(model: Any) -> list[nn.Module]:
    """The QwenImageTransformer2DModel instances in ``model`` (a pipeline, a transformer, or any module tree)."""
    t = sys.modules.get(_targets.TRANSFORMER)
    if t is None:
        return []
    cls = t.QwenImageTransformer2DModel
    if isinstance(model, cls):
        return [model]
    found = []
    tr = getattr(model, "transformer", None)
    if isinstance(tr, cls):
        found.append(tr)
    if isinstance(model, nn.Module):
        found.extend(m for m in model.modules() if isinstance(m, cls) and m is not tr)
    return found


def modulation_linears(transformer: nn.Module) -> list[nn.Module]:
    """Every projection whose output depends only on temb: each block's img_mod/txt_mod linear and norm_out.linear."""
    out = [seq._modules["1"] for b in transformer.transformer_blocks for seq in (b.img_mod, b.txt_mod)]
    out.append(transformer.norm_out.linear)
    return out


def unkeyable_reasons(transformer: nn.Module) -> list[str]:
    """Why the memo cannot key some of ``transformer``'s projections (the per-call checks, made on the model)."""
    reasons = []
    for block in transformer.transformer_blocks:
        try:
            _block_parts(block, grad=False)
        except _Unkeyable as exc:
            reasons.append(str(exc))
    norm = transformer.norm_out
    try:
        _norm_out_linear(norm, grad=False)
    except _Unkeyable as exc:
        reasons.append(str(exc))
    return list(dict.fromkeys(reasons))


def block_body_reason(transformer: nn.Module) -> str | None:
    """Why shared_modulation's memoized block body does not run in some blocks of ``transformer`` (None: it runs
    wherever the block forward is called): a vLLM-Omni hook registry (MagCache, layerwise offload, SP) that was
    installed before shared_modulation captured the stock forward. Those blocks still read their projections from
    the memo (the swapped ``img_mod``/``txt_mod``); the fast tier's modes do not run there."""
    patched = sys.modules[_targets.TRANSFORMER].QwenImageTransformerBlock.forward
    n = 0
    for block in transformer.transformer_blocks:
        captured = block.__dict__.get("_omni_original_forward")
        if captured is not None and getattr(captured, "__func__", None) is not patched:
            n += 1
    if not n:
        return None
    return (
        f"a vLLM-Omni hook captured the block forward of {n} block(s) before shared_modulation was installed: "
        "they run stock's block with memoized projections"
    )


OPT = SharedModulation()
