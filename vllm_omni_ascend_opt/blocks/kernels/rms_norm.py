"""The ``torch_npu.npu_rms_norm`` kernel path: its shape class, its fp32 reference and tolerance, and the norm class.

``qk_norm`` swaps the QK norms to :class:`KernelRMSNorm` and offers its :class:`RmsNormPath` in :data:`NORM`;
``joint_attention`` asks :func:`kernel_ready` whether all four norms of a layer will take the kernel. Check, on the
first real call of each shape class: the output against ``x32 * rsqrt(mean(x32^2) + eps) * w32`` in chunks of rows,
finite and within ``(TOLERANCE_EPS_FACTOR * eps(dtype) + RSTD_SLACK * eps(fp32)) * |ref|``. Documented limits
[OP-RMS] (Ascend/op-plugin ``torch_npu-npu_rms_norm.md``): fp16/bf16/fp32, gamma of self's dtype and trailing dims,
self 2-8 dims.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

import torch
import torch.nn as nn

from vllm_omni_ascend_opt.blocks.kernels.guard import bucket
from vllm_omni_ascend_opt.blocks.kernels.verdicts import Verdict
from vllm_omni_ascend_opt.blocks.kernels.verified import Candidate, KernelPath
from vllm_omni_ascend_opt.blocks.slots import Slot
from vllm_omni_ascend_opt.blocks.upstream import guards

KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # [OP-RMS]
KERNEL_DIMS = (2, 8)  # [OP-RMS]: self 2-8 dims
TOLERANCE_EPS_FACTOR = 2.0
RSTD_SLACK = 16.0
#: at most this many elements per chunk of the fp32 reference
VERIFY_CHUNK_ELEMS = 1 << 22
#: fp32 chunk-sized temporaries alive at once in the check (x32, ref, err, bound, stock): its device scratch
_CHECK_TEMPS = 6


def shape_class(x: torch.Tensor) -> tuple[str, torch.dtype, int, int]:
    """(device, dtype, rows bucket = next power of two of numel / D, D): what the kernel's tiling depends on."""
    d = x.shape[-1]
    return (str(x.device), x.dtype, bucket(x.numel() // max(1, d)), d)


class RmsNormPath(KernelPath):
    """``npu_rms_norm`` for the norms swapped to :class:`KernelRMSNorm`; counts ``kernel_calls`` / ``stock_calls``."""

    kernel = "npu_rms_norm"
    candidates = (Candidate("npu_rms_norm", "pixel"),)

    def place(self, key: tuple) -> str:
        dev, dtype, rows, d = key
        return f"{dev}/{str(dtype).removeprefix('torch.')} rows<={rows} D={d}"

    def apply(self, norm: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
        """``norm(x)`` through the verified kernel, or None (stock ``nn.RMSNorm.forward``); never under dynamo."""
        fn = self.function()
        w, eps = norm.weight, norm.eps
        out = None
        if (
            fn is not None
            and w is not None
            and eps is not None
            and guards.call_reason(any_grad=True, hooks=False) is None
            and x.dtype in KERNEL_DTYPES
            and w.dtype == x.dtype  # [OP-RMS]: gamma's dtype must equal self's
            and KERNEL_DIMS[0] <= x.dim() <= KERNEL_DIMS[1]
            and tuple(w.shape) == tuple(x.shape[-1:]) == tuple(norm.normalized_shape)
        ):
            out = self._call(fn, x, w, float(eps))
        self.stats["stock_calls" if out is None else "kernel_calls"] += 1
        return out

    def _call(self, fn: object, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor | None:
        return self.call(
            shape_class(x),
            lambda: fn(x, w, epsilon=eps)[0],  # type: ignore[operator]
            lambda out: self.check(x, out, w, eps),
            lambda: _CHECK_TEMPS * 4 * min(x.numel(), max(x.shape[-1], VERIFY_CHUNK_ELEMS)),
            x.device,
            stock=lambda: nn.functional.rms_norm(x, (x.shape[-1],), w, eps),
        )

    def check(self, x: torch.Tensor, out: torch.Tensor, weight: torch.Tensor, eps: float) -> Verdict:
        """The kernel's ``out`` for the real ``x`` against the fp32 reference, in chunks of rows."""
        t0 = time.perf_counter()
        key = shape_class(x)
        if not isinstance(out, torch.Tensor) or out.shape != x.shape or out.dtype != x.dtype or out.device != x.device:
            got = (getattr(out, "shape", None), getattr(out, "dtype", None))
            return self.verdict(key, False, f"wrong output (shape, dtype) {got}, expected {(tuple(x.shape), x.dtype)}")
        d = x.shape[-1]
        xs, os_ = x.reshape(-1, d), out.reshape(-1, d)
        step = max(1, VERIFY_CHUNK_ELEMS // max(1, d))
        rel = TOLERANCE_EPS_FACTOR * torch.finfo(x.dtype).eps + RSTD_SLACK * torch.finfo(torch.float32).eps
        ratio, err, same = 0.0, 0.0, True
        for i in range(0, xs.shape[0], step):
            xc, oc = xs[i : i + step], os_[i : i + step]
            x32 = xc.float()  # the fp32 reference on the same (rounded) input
            ref = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
            if not bool(torch.isfinite(oc).all()):
                ratio = math.inf
                break
            e = (oc.float() - ref).abs()
            bound = rel * ref.abs() + torch.finfo(torch.float32).tiny
            ratio, err = max(ratio, float((e / bound).max())), max(err, float(e.max()))
            same = same and bool(torch.equal(oc, nn.functional.rms_norm(xc, (d,), weight, eps)))
        facts = {"bitwise": same, "errors": {"kernel": err, "over_bound": ratio}, "seconds": time.perf_counter() - t0}
        if not ratio <= 1.0:
            why = (
                f"output differs from the fp32 reference by up to {ratio:.3g}x the tolerance "
                f"(({TOLERANCE_EPS_FACTOR:g}*eps(dtype) + {RSTD_SLACK:g}*eps(fp32))*|ref|)"
            )
            return self.verdict(key, False, why, **facts)
        why = f"max error {err:.3g}, {ratio:.3g} of the bound; bitwise equal to stock: {'yes' if same else 'no'}"
        return self.verdict(key, True, why, **facts)

    def warm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> bool | None:
        """Check the class of ``x`` now (``warmup``), as its first real call would: the verdict, or None."""
        fn = self.function() if x.dtype in KERNEL_DTYPES else None
        if fn is not None and self.settled(shape_class(x)) is None:
            self._call(fn, x, weight, eps)
        return None if fn is None else self.settled(shape_class(x))


#: The kernel path of the swapped norms (``qk_norm`` provides it while installed).
NORM: Slot[RmsNormPath] = Slot("npu_rms_norm")


class KernelRMSNorm(nn.RMSNorm):
    """``nn.RMSNorm`` running the verified kernel where it can (swapped in per instance); stock's under dynamo."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if guards.tracing():
            return nn.RMSNorm.forward(self, x)
        path = NORM.get()
        y = path.apply(self, x) if path is not None else None
        return nn.RMSNorm.forward(self, x) if y is None else y


#: The classes whose forward computes stock ``nn.RMSNorm`` (within the kernel's verified tolerance).
RMS_NORM_CLASSES: tuple[type[nn.Module], ...] = (nn.RMSNorm, KernelRMSNorm)


def kernel_ready(norms: Sequence[nn.Module | None]) -> bool:
    """Every norm in ``norms`` carries the kernel class and the kernel exists (False without a provider)."""
    path = NORM.get()
    return path is not None and all(isinstance(n, KernelRMSNorm) for n in norms) and path.function() is not None
