"""`qk_norm`: Run Qwen-Image's four QK RMSNorms per block as torch_npu.npu_rms_norm, verified per shape class against an fp32 reference.

Patch header (vllm-ascend ``vllm_ascend/patch/`` style)
-------------------------------------------------------
Patched objects: per model instance, never process-wide. :meth:`QkNorm.attach` gives the four ``nn.RMSNorm``
modules of every ``QwenImageCrossAttention`` (``norm_q``, ``norm_k``, ``norm_added_q``, ``norm_added_k``) a subclass
whose ``forward`` calls the kernel (``__class__`` swap: same object, same parameters); ``detach`` restores the class.

Why: torch_npu 2.13.0 registers no NPU kernel for ``aten::rms_norm`` (only ``native_layer_norm`` among the norms),
so stock ``nn.RMSNorm`` runs on an NPU as its composite pieces: ``_to_copy``, ``pow``, ``mean``, ``add_``,
``rsqrt``, ``mul``, ``mul``, ``_to_copy`` - 8 launches in bf16, 32 per block for the four QK norms.
``torch_npu.npu_rms_norm(self, gamma, epsilon=1e-06) -> (Tensor, Tensor)`` (schema in the torch-npu 2.13.0 wheel's
``npu_native_functions_by_codegen.yaml``; [OP-RMS] Ascend/op-plugin ``torch_npu-npu_rms_norm.md``) is one.

How: each call that fits the documented constraints ([OP-RMS]: self and gamma float16/bfloat16/float32 of the same
dtype, self 2-8 dims, gamma the trailing dims of self - here ``[head_dim]``) runs ``npu_rms_norm(x, weight,
epsilon=eps)[0]``. On the first call of each shape class (device, dtype, rows bucket = next power of two of
``numel / D``, D) the kernel's output on the real input is compared with an fp32 reference
(``x32 * rsqrt(mean(x32^2) + eps) * w32``, computed in chunks of rows, :data:`VERIFY_CHUNK_ELEMS`): every element must
be within ``(TOLERANCE_EPS_FACTOR * eps(dtype) + RSTD_SLACK * eps(fp32)) * |ref|`` (one rounding to the dtype, 2x
headroom, plus a reduction-order allowance for the fp32 rstd) and finite. A class that fails, or whose first call
raises a TypeError/ValueError, keeps stock's composite with the reason logged (``notes()``/``verdicts()``); an error
of the moment (out of memory, a runtime error) in the check or the kernel costs that call only (stock runs it) and
the class is retried after the backoff of :mod:`vllm_omni_ascend_opt.blocks.kernels.guard`. Anything else (autograd,
``torch.compile``, graph capture, an ineligible dtype/shape, no torch_npu) runs stock ``nn.RMSNorm.forward``.

With ``joint_attention`` (text and image rows of one joint q or k): ``gamma`` must be ``[D]``, so one kernel cannot
apply the two streams' weights. Counted per block for q, k and v (npu_rotary_mul once per q/k on the joint sequence
either way): (a) one ``npu_rms_norm`` per stream on stock's views, then one ``cat`` each for q, k and v: 4 + 3 = 7,
9 with the rotary calls, and v stays contiguous for ``npu_fusion_attention``; (b) one ``cat`` of the two QKV
projections, one kernel per stream on its row ranges and one ``cat`` each for q and k: 1 + 4 + 2 = 7 too, but v
is a strided view that the fused attention copies (one more launch); (c) a joint ``npu_rms_norm`` with gamma = ones
and a per-row weight-table ``mul``: 1 + 2 + 2 = 5, but a second rounding and per-block [S, D] weight tables to keep
(and invalidate) per shape; (d) stock's order (norm and rotate each stream, three cats): 4 + 4 + 3 = 11.
``joint_attention`` implements (a) when this optimization is attached (:meth:`QkNorm.ready`, which it asks through
:func:`vllm_omni_ascend_opt.blocks.kernels.rms_norm.kernel_ready`, never by importing this module).

Where the code lives: the kernel class (:class:`~vllm_omni_ascend_opt.blocks.kernels.rms_norm.KernelRMSNorm`) and its
readiness are a shared block: this optimization provides the kernel
(:func:`~vllm_omni_ascend_opt.blocks.kernels.rms_norm.provide` on install) and swaps the class in on attach; its verdicts live in a
:class:`~vllm_omni_ascend_opt.blocks.kernels.verdicts.VerdictCache` (a new backend probe drops them, uninstall clears them).
While ``torch.compile`` traces, the kernel class runs stock ``nn.RMSNorm.forward`` at once (checked first: nothing
is read, counted or logged).

Tier: the kernel computes in fp32 and rounds once; its fp32 reduction order may differ from stock's, so outputs may
differ in the last bits: ``pixel`` (uint8-identical images), verified on the tiny workload; ``exact`` where it
cannot run (nothing changes).

Upstream PR: none (vllm-ascend uses ``npu_rms_norm`` in its ``RMSNorm`` custom op for LLMs, not in vLLM-Omni's DiT).
Removal plan: drop when torch_npu registers ``aten::rms_norm`` for NPU or vLLM-Omni's Qwen-Image uses an NPU RMSNorm.
"""

from __future__ import annotations

import logging
import math
import sys
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from vllm_omni_ascend_opt import _backend
from vllm_omni_ascend_opt.blocks.kernels import guard as kguard
from vllm_omni_ascend_opt.blocks.kernels import rms_norm
from vllm_omni_ascend_opt.blocks.kernels.verdicts import VerdictCache
from vllm_omni_ascend_opt.blocks.upstream import forward_scope, guards
from vllm_omni_ascend_opt.blocks.upstream import targets as _targets
from vllm_omni_ascend_opt.optimization import PARALLEL_MODES, Optimization

logger = logging.getLogger("vllm_omni_ascend_opt")

KERNEL = "npu_rms_norm"
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # [OP-RMS]
KERNEL_DIMS = (2, 8)  # [OP-RMS]: self 2-8 dims
#: Per element: |kernel - ref_fp32| <= (K * eps(dtype) + RSTD_SLACK * eps(fp32)) * |ref|. A kernel that computes in
#: fp32 and rounds once errs by <= eps/2 * |ref| plus its fp32 rstd error (a different reduction order and rsqrt:
#: a few eps(fp32)); a kernel that ignores gamma, eps or the row, or rounds inside to 16 bits on fp32 inputs, errs
#: by orders of magnitude more.
TOLERANCE_EPS_FACTOR = 2.0
RSTD_SLACK = 16.0
#: Shape-class verification: at most this many elements per chunk of the fp32 reference.
VERIFY_CHUNK_ELEMS = 1 << 22
#: fp32 chunk-sized temporaries alive at once in :func:`verify_at_shape` (x32, ref, err, bound, stock).
_CHECK_TEMPS = 6
NORM_NAMES = ("norm_q", "norm_k", "norm_added_q", "norm_added_k")


def reference_fp32(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x32 * rsqrt(mean(x32^2, -1) + eps) * w32``: the RMSNorm in fp32 on the same (rounded) input."""
    x32 = x.float()
    return x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * weight.float()


def check_scratch_bytes(x: torch.Tensor) -> int:
    """Device scratch of :func:`verify_at_shape` on ``x``: a few fp32 chunks of at most :data:`VERIFY_CHUNK_ELEMS`."""
    return _CHECK_TEMPS * 4 * min(x.numel(), max(x.shape[-1], VERIFY_CHUNK_ELEMS))


def shape_class(x: torch.Tensor) -> tuple[str, torch.dtype, int, int]:
    """(device, dtype, rows bucket = next power of two of numel / D, D): what the kernel's tiling depends on."""
    d = x.shape[-1]
    rows = x.numel() // max(1, d)
    return (str(x.device), x.dtype, kguard.bucket(rows), d)


@dataclass
class NormVerdict:
    """Outcome of checking ``npu_rms_norm`` on the first real call of one shape class."""

    key: tuple[str, torch.dtype, int, int]
    ok: bool
    reason: str = ""
    max_err_over_bound: float = math.nan
    max_err: float = math.nan
    bitwise_vs_stock: bool = False
    seconds: float = 0.0

    def describe(self) -> str:
        dev, dtype, rows, d = self.key
        where = f"{dev}/{str(dtype).removeprefix('torch.')} rows<={rows} D={d}"
        if self.ok:
            return (
                f"{KERNEL} at {where}: in use (max error {self.max_err:.3g}, {self.max_err_over_bound:.3g} of the "
                f"bound; bitwise equal to stock: {'yes' if self.bitwise_vs_stock else 'no'}; check took "
                f"{self.seconds * 1e3:.1f} ms)"
            )
        return f"{KERNEL} at {where}: refused ({self.reason}); stock nn.RMSNorm is used for this shape class"


def verify_at_shape(x: torch.Tensor, out: torch.Tensor, weight: torch.Tensor, eps: float) -> NormVerdict:
    """Check the kernel's ``out`` for the real ``x`` against the fp32 reference, in chunks of rows."""
    t0 = time.perf_counter()
    v = NormVerdict(shape_class(x), ok=False)
    if not isinstance(out, torch.Tensor) or out.shape != x.shape or out.dtype != x.dtype or out.device != x.device:
        got = (getattr(out, "shape", None), getattr(out, "dtype", None))
        v.reason = f"wrong output (shape, dtype) {got}, expected {(tuple(x.shape), x.dtype)}"
        return v
    d = x.shape[-1]
    xs, os_ = x.reshape(-1, d), out.reshape(-1, d)
    step = max(1, VERIFY_CHUNK_ELEMS // max(1, d))
    eps_dtype = torch.finfo(x.dtype).eps
    rel = TOLERANCE_EPS_FACTOR * eps_dtype + RSTD_SLACK * torch.finfo(torch.float32).eps
    ratio, err, same = 0.0, 0.0, True
    for i in range(0, xs.shape[0], step):
        xc, oc = xs[i : i + step], os_[i : i + step]
        ref = reference_fp32(xc, weight, eps)
        if not bool(torch.isfinite(oc).all()):
            ratio = math.inf
            break
        e = (oc.float() - ref).abs()
        bound = rel * ref.abs() + torch.finfo(torch.float32).tiny
        ratio, err = max(ratio, float((e / bound).max())), max(err, float(e.max()))
        same = same and bool(torch.equal(oc, nn.functional.rms_norm(xc, (d,), weight, eps)))
    v.max_err_over_bound, v.max_err, v.bitwise_vs_stock = ratio, err, same
    if not ratio <= 1.0:
        v.reason = (
            f"output differs from the fp32 reference by up to {ratio:.3g}x the tolerance "
            f"(({TOLERANCE_EPS_FACTOR:g}*eps(dtype) + {RSTD_SLACK:g}*eps(fp32))*|ref|)"
        )
    v.ok = not v.reason
    _backend.synchronize(x.device if x.device.type != "cpu" else None)
    v.seconds = time.perf_counter() - t0
    return v


class QkNorm(Optimization):
    name = "qk_norm"
    summary = "Run Qwen-Image's four QK RMSNorms per block as torch_npu.npu_rms_norm, verified per shape class against an fp32 reference."
    equivalence = "pixel"
    default_enabled = True
    requires = ("torch_npu with npu_rms_norm (float16/bfloat16/float32)",)
    target_modules = (_targets.TRANSFORMER,)
    parallel_support = dict.fromkeys(PARALLEL_MODES, "supported")  # per-row op on whatever rows a rank holds
    regions = frozenset({"block"})
    removal_plan = "Drop when torch_npu registers aten::rms_norm for NPU or vLLM-Omni's Qwen-Image uses an NPU RMSNorm."
    #: Where the swapped norms are called (before RoPE, on [B, S, H, D]) and how they are built (nn.RMSNorm, [D]).
    upstream = (_targets.QK_NORM_ROPE, _targets.CROSS_ATTENTION_INIT)
    on_qwen_image_21 = (
        "its QK norms are diffusers' RMSNorm, which already calls torch_npu.npu_rms_norm whenever torch_npu imports"
    )

    def __init__(self) -> None:
        super().__init__()
        #: Per :func:`shape_class`: the check on the first real call of the class.
        self._verdicts: VerdictCache[NormVerdict] = VerdictCache(
            KERNEL,
            lambda key, ok, reason: NormVerdict(key, ok=ok, reason=reason),  # type: ignore[arg-type]
        )
        #: Faults of the checks and kernel calls per shape class, retried with backoff.
        self._guard = kguard.Guard(self.name, self.stats)
        self._swapped: weakref.WeakKeyDictionary[nn.Module, type] = weakref.WeakKeyDictionary()

    # ----- reporting -----------------------------------------------------------------------------------------
    def _process_reasons(self) -> list[str]:
        mod = _backend.torch_npu_module()
        if mod is None:
            return _backend.npu_unavailable_reasons() or ["torch_npu unavailable"]
        if getattr(mod, KERNEL, None) is None:
            return [f"{_backend.backend_label()} has no {KERNEL}"]
        return []

    def _model_reasons(self, model: nn.Module) -> list[str]:
        norms = _qk_norms(model)
        if not norms:
            return ["no QwenImageCrossAttention with nn.RMSNorm QK norms in this model"]
        if not any(n in self._swapped for n in norms):
            return ["not attached to this model's QK norms"]
        verdicts = self.verdicts()
        if verdicts and not any(v.ok for v in verdicts):
            return [f"{KERNEL} refused at every shape class so far: {verdicts[0].reason}"]
        return []

    def tier(self) -> str:
        """``pixel`` where the kernel runs (or will, once verified); ``exact`` where it cannot (nothing changes)."""
        if self.reasons_inactive():
            return "exact"
        verdicts = self.verdicts()
        return "exact" if verdicts and not any(v.ok for v in verdicts) else "pixel"

    def notes(self) -> list[str]:
        s = self.stats
        out = [v.describe() for v in self.verdicts()]
        out.extend(f"{KERNEL} fault: {f.describe()}" for f in self._guard.faults())
        t = self.kernel_classes()
        if t is not None:
            out.append(kguard.tally_line(KERNEL, t))
        out.append(f"{KERNEL} calls {s['kernel_calls']}, stock calls {s['stock_calls']}")
        return out

    def cache_memory(self) -> dict[str, Any]:
        """No cache; the fp32 scratch peak its checks were sized to."""
        return {"bytes": 0, "check_scratch_peak_bytes": self._guard.scratch_peak}

    def kernel_classes(self) -> dict[str, Any] | None:
        if self._process_reasons():
            return None
        return kguard.tally(self.verdicts(), self._guard.faults())

    def verdicts(self) -> list[NormVerdict]:
        """The per-shape-class checks of the kernel so far (for the current backend probe)."""
        return self._verdicts.values()

    # ----- install / attach ----------------------------------------------------------------------------------
    def _install(self) -> None:
        rms_norm.provide(self)

    def _uninstall(self) -> None:
        rms_norm.withdraw(self)
        for module, cls in list(self._swapped.items()):
            module.__class__ = cls
        self._swapped = weakref.WeakKeyDictionary()
        self._verdicts.clear()
        self._guard.clear()

    def _attach(self, model: nn.Module) -> None:
        for tr in guards.find_transformers(model):
            forward_scope.watch(tr, self.name)  # the fault-backoff clock counts its forwards
        for n in _qk_norms(model):
            if type(n) is nn.RMSNorm and n not in self._swapped:
                self._swapped[n] = nn.RMSNorm
                n.__class__ = rms_norm.KernelRMSNorm

    def _detach(self, model: nn.Module) -> None:
        for tr in guards.find_transformers(model):
            forward_scope.unwatch(tr, self.name)
        for n in _qk_norms(model):
            cls = self._swapped.pop(n, None)
            if cls is not None:
                n.__class__ = cls

    # ----- backend choice (the one place) --------------------------------------------------------------------
    def _kernel(self) -> Any:
        mod = _backend.torch_npu_module()
        return None if mod is None else getattr(mod, KERNEL, None)

    def apply(self, norm: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
        """``norm(x)`` through the verified kernel, or None (the caller runs stock ``nn.RMSNorm.forward``).

        Called by :class:`~vllm_omni_ascend_opt.blocks.kernels.rms_norm.KernelRMSNorm` after its ``guards.tracing()``
        check: never while dynamo traces."""
        kernel = self._kernel() if norm in self._swapped else None
        w, eps = norm.weight, norm.eps
        if (
            kernel is None
            or w is None
            or eps is None
            or guards.call_reason(any_grad=True, hooks=False) is not None
            or x.dtype not in KERNEL_DTYPES
            or w.dtype != x.dtype  # [OP-RMS]: gamma's dtype must equal self's
            or not KERNEL_DIMS[0] <= x.dim() <= KERNEL_DIMS[1]
            or tuple(w.shape) != tuple(x.shape[-1:])
            or tuple(norm.normalized_shape) != tuple(x.shape[-1:])
        ):
            self.stats["stock_calls"] += 1
            return None
        key = shape_class(x)
        checked = self._verdicts.get(key)
        if (checked is not None and not checked.ok) or self._guard.waits(key):
            self.stats["stock_calls"] += 1
            return None
        _, out, refusal = self._guard.run(key, lambda: self._kernel_call(kernel, x, w, float(eps), checked is None))
        if refusal:
            refused = self._verdicts.put(key, NormVerdict(key, ok=False, reason=refusal))
            logger.warning("vllm-omni-ascend-opt: qk_norm: %s", refused.describe())
        if out is None:
            self.stats["stock_calls"] += 1
            return None
        self.stats["kernel_calls"] += 1
        return out

    def _kernel_call(self, kernel: Any, x: torch.Tensor, w: torch.Tensor, eps: float, check: bool) -> Any:
        """The kernel on ``x`` and, on the first call of its class, the check (inside the guard: whatever it raises
        costs this call only). None: stock for this call (refused here, or the check deferred for memory)."""
        key = shape_class(x)
        if check and not self._guard.fits(key, x.device, check_scratch_bytes(x)):
            return None
        out = kernel(x, w, epsilon=eps)[0]
        if not check:
            return out
        made = verify_at_shape(x, out, w, eps)
        usable = self._verdicts.put(key, made).ok  # under several ranks a pass waits for the others (agree.py)
        self.stats["shape_checks"] += 1
        (logger.info if made.ok else logger.warning)("vllm-omni-ascend-opt: qk_norm: %s", made.describe())
        return out if usable else None

    def warm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> bool | None:
        """Check the kernel's class of ``x`` now (``warmup``), as its first real call would: the verdict (ok), or
        None (no kernel here, or the check faulted or was deferred). A class already decided is not checked again."""
        kernel = self._kernel()
        if kernel is None or x.dtype not in KERNEL_DTYPES:
            return None
        key = shape_class(x)
        if self._verdicts.get(key) is None and not self._guard.waits(key):
            self._guard.run(key, lambda: self._kernel_call(kernel, x, weight, eps, True))
        v = self._verdicts.get(key)
        return None if v is None else v.ok

    def ready(self, norms: Sequence[nn.Module | None]) -> bool:
        """Whether every norm in ``norms`` carries the kernel class (attached here) and torch_npu has the kernel:
        what ``joint_attention`` asks, through ``blocks.kernels.rms_norm.kernel_ready``, to choose its per-stream order."""
        return all(n is not None and n in self._swapped for n in norms) and self._kernel() is not None

    def is_prepared(self, norm: nn.Module) -> bool:
        return norm in self._swapped


def _qk_norms(model: Any) -> list[nn.Module]:
    mod = sys.modules.get(_targets.TRANSFORMER)
    if mod is None or not isinstance(model, nn.Module):
        return []
    out = []
    for m in model.modules():
        if isinstance(m, mod.QwenImageCrossAttention):
            out.extend(n for n in (getattr(m, name, None) for name in NORM_NAMES) if isinstance(n, nn.RMSNorm))
    return out


OPT = QkNorm()
