"""The ``torch_npu.npu_rotary_mul`` kernel path and the rotary service that runs it: ``rope`` owns a
:class:`RotaryPath` and offers it in :data:`ROTARY`; ``joint_attention`` rotates through it, or with the portable
math of :mod:`.rope_tables` when the slot is empty.

Checks: once per (device, dtype, head_dim) on small random BSND inputs (a kernel that pairs halves errs by orders of
magnitude), and on the first real call of each :func:`shape_class`, in chunks over S. Bound, per element:
``|kernel - ref_fp32| <= K * eps(dtype) * (|x*cos| + |swap(x)*sin|)``, K = :data:`TOLERANCE_EPS_FACTOR`, and the
kernel's max error no larger than stock's own.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

from vllm_omni_ascend_opt import _backend
from vllm_omni_ascend_opt.blocks.kernels.guard import bucket, is_error
from vllm_omni_ascend_opt.blocks.kernels.rope_tables import (
    TableCache,
    Tables,
    apply_portable,
    apply_portable_,
    half_tables,
    native_equivalent,
    npu_tables,
    portable_tables,
    swap_pairs,
)
from vllm_omni_ascend_opt.blocks.kernels.verdicts import Verdict
from vllm_omni_ascend_opt.blocks.kernels.verified import Candidate, KernelPath
from vllm_omni_ascend_opt.blocks.slots import Slot

#: The kernel policy's environment variable (read by ``rope``; named in the refusals it causes).
ENV_KERNEL_POLICY = "VLLM_OMNI_ASCEND_OPT_ROPE_KERNEL"
TOLERANCE_EPS_FACTOR = 2.0
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # npu_rotary_mul doc: fp16/bf16/fp32
KERNEL_D_LIMIT = 896  # npu_rotary_mul doc: D < 896 and even
KERNEL_BN_LIMIT = 1000  # npu_rotary_mul doc, interleave: B * N < 1000
#: Shape-class check: chunk the fp32 reference over S so that one chunk holds at most this many elements.
VERIFY_CHUNK_ELEMS = 1 << 22
#: fp32 chunk-sized temporaries alive at once in the class check (x, out, ref, scale, err, stock, swap).
_CHECK_TEMPS = 8


def check_scratch_bytes(x: torch.Tensor) -> int:
    """Device scratch of the class check on ``x``: a few fp32 chunks of at most :data:`VERIFY_CHUNK_ELEMS`."""
    b, s, n, d = x.shape
    step = max(1, VERIFY_CHUNK_ELEMS // max(1, b * n * d))
    return _CHECK_TEMPS * 4 * b * min(s, step) * n * d


def reference_fp32(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The portable math in fp32 on the same inputs, and ``|x*cos| + |swap(x)*sin|`` (the error scale)."""
    x32, c32, s32 = x.float(), cos.float(), sin_signed.float()
    a, b = x32 * c32, swap_pairs(x32) * s32
    return a + b, a.abs() + b.abs()


def errors(
    x: torch.Tensor, out: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor
) -> tuple[float, float, float, bool]:
    """(max error / bound, max |out - ref|, max |stock - ref|, out bitwise stock) over S in chunks; inf if not finite."""
    b, s, n, d = x.shape
    step = max(1, VERIFY_CHUNK_ELEMS // max(1, b * n * d))
    ratio, err_k, err_s, same = 0.0, 0.0, 0.0, True
    for i in range(0, s, step):
        xc, oc, cc, sc = x[:, i : i + step], out[:, i : i + step], cos[i : i + step], sin_signed[i : i + step]
        stock = apply_portable(xc, cc, sc)
        ref, scale = reference_fp32(xc, cc, sc)
        err_s = max(err_s, float((stock.float() - ref).abs().max()))
        same = same and bool(torch.equal(oc, stock))
        if not bool(torch.isfinite(oc).all()):
            ratio, err_k = math.inf, math.inf
            continue
        err = (oc.float() - ref).abs()
        bound = TOLERANCE_EPS_FACTOR * torch.finfo(x.dtype).eps * scale + torch.finfo(torch.float32).tiny
        ratio, err_k = max(ratio, float((err / bound).max())), max(err_k, float(err.max()))
    return ratio, err_k, err_s, same


def shape_class(x: torch.Tensor) -> tuple[str, torch.dtype, str, int, int, int]:
    """(device, dtype, layout, B*N bucket, S bucket, D) of a BSND input: what the kernel's tiling depends on (B*N is
    bucketed like S, so CFG's batch of 2 and a sequence-parallel head split share classes)."""
    b, s, n, d = x.shape
    return (str(x.device), x.dtype, "BSND", bucket(b * n), bucket(s), d)


class RotaryPath(KernelPath):
    """Cached tables and the backend choice for one owner: the verified ``npu_rotary_mul``, else the portable math
    (where stock runs ``forward_native``), else stock's own rotary kernel with cached tables."""

    kernel = "npu_rotary_mul"
    candidates = (Candidate("npu_rotary_mul", "pixel"),)

    def __init__(self, policy: Any, stats: Counter, label: str) -> None:
        super().__init__(label, stats)
        self.policy = policy  # rope's: use_npu_kernel, requires_bitwise()
        self.tables = TableCache(stats)

    def place(self, key: tuple) -> str:
        dev, dtype = key[0], str(key[1]).removeprefix("torch.")
        if len(key) == 3:
            return f"{dev}/{dtype}/D={key[2]}"
        _, _, layout, bn, s, d = key
        return f"{dev}/{dtype}/{layout} B*N<={bn} S<={s} D={d}"

    def accept_saved(self, key: tuple, ok: bool) -> bool:
        return not (ok and self.policy.requires_bitwise())  # whether a pass was bitwise is not saved: check again

    def clear(self) -> None:
        """Drop tables, verdicts and faults."""
        super().clear()
        self.tables.clear()

    def _verdict(self, key: tuple, errs: tuple[float, float, float, bool], seconds: float = 0.0) -> Verdict:
        """The verdict on the kernel's :func:`errors`: why they are unacceptable under the policy, else the evidence."""
        ratio, err_k, err_s, same = errs
        facts = {"bitwise": same, "errors": {"kernel": err_k, "stock": err_s, "over_bound": ratio}, "seconds": seconds}
        why = ""
        if not ratio <= 1.0:
            why = (
                f"output differs from the fp32 reference by up to {ratio:.3g}x the tolerance "
                f"({TOLERANCE_EPS_FACTOR:g}*eps*(|x*cos|+|rot(x)*sin|))"
            )
        elif not err_k <= err_s:
            why = f"max error {err_k:.3g} against the fp32 reference exceeds stock's own {err_s:.3g} in this dtype"
        elif self.policy.requires_bitwise() and not same:
            why = (
                f"within tolerance but not bitwise-equal to stock, and {ENV_KERNEL_POLICY}=bitwise keeps rope in the "
                "exact tier (the default policy 'pixel' accepts it)"
            )
        evidence = (
            f"max error {err_k:.3g} vs stock's {err_s:.3g}, {ratio:.3g} of the bound; bitwise equal to stock: "
            f"{'yes' if same else 'no'}"
        )
        return self.verdict(key, not why, why or evidence, **facts)

    def first_check(self, fn: Callable[..., torch.Tensor], device: Any, dtype: torch.dtype, d: int, n: int) -> Verdict:
        """The kernel against the portable reference on small random inputs of the real layout (BSND) and dtype."""
        key = (str(device), dtype, d)
        if dtype not in KERNEL_DTYPES:
            return self.verdict(key, False, f"dtype {dtype} is not supported by npu_rotary_mul")
        if d % 2 or d >= KERNEL_D_LIMIT:
            return self.verdict(key, False, f"head_dim {d} is not even and < {KERNEL_D_LIMIT}")
        g = torch.Generator().manual_seed(0x5EED)
        x = (torch.randn(2, 37, max(1, min(n, 8)), d, generator=g) * 3.0).to(dtype)
        theta = torch.rand(37, d // 2, generator=g, dtype=torch.float64) * (2 * math.pi * 64)
        freqs = torch.polar(torch.ones_like(theta), theta).to(torch.complex64)
        try:
            x, freqs = x.to(device), freqs.to(device)
            tables, scratch = Tables(dtype), Counter()
            cos, sin_signed = portable_tables(tables, freqs, scratch)
            out = fn(x, *npu_tables(tables, freqs, scratch), rotary_mode="interleave")
        except Exception as exc:
            if is_error(exc):  # out of memory, a runtime error: a fault, for the guard (not a verdict)
                raise
            return self.verdict(key, False, f"the kernel raised {exc.__class__.__name__}: {exc}")
        if not isinstance(out, torch.Tensor) or out.shape != x.shape or out.dtype != dtype or out.device != x.device:
            got = (getattr(out, "shape", None), getattr(out, "dtype", None), getattr(out, "device", None))
            return self.verdict(key, False, f"wrong output (shape, dtype, device) {got}, expected {(x.shape, dtype)}")
        v = self._verdict(key, errors(x, out, cos, sin_signed))
        if not v.ok:
            v.reason += "; wrong pairing mode or precision"
        return v

    def class_check(self, x: torch.Tensor, out: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> Verdict:
        """The kernel's ``out`` for the real BSND ``x`` against the fp32 reference on this call's portable tables."""
        t0 = time.perf_counter()
        key = shape_class(x)
        if out.shape != x.shape or out.dtype != x.dtype or out.device != x.device:
            return self.verdict(key, False, f"wrong output {tuple(out.shape)} {out.dtype} {out.device}")
        errs = errors(x, out, cos, sin_signed)
        return self._verdict(key, errs, time.perf_counter() - t0)

    def kernel_for(self, x: torch.Tensor) -> Callable[..., torch.Tensor] | None:
        """The verified ``npu_rotary_mul`` for ``x``'s (device, dtype, head_dim), or None (absent, refused, faulted)."""
        if not self.policy.use_npu_kernel or _backend.torch_npu_module() is None:
            return None
        fn = self.function()
        key = (str(x.device), x.dtype, x.shape[-1])
        if fn is None:
            v = self.decide(key, lambda: self.verdict(key, False, "torch_npu has no npu_rotary_mul"))
        else:
            v = self.decide(key, lambda: self.first_check(fn, x.device, x.dtype, x.shape[-1], x.shape[2]))
        return fn if v is not None and v.ok else None

    def _kernel(self, fn: Callable[..., torch.Tensor], x: torch.Tensor, tables: Tables, freqs: torch.Tensor) -> Any:
        return self.call(
            shape_class(x),
            lambda: fn(x, *npu_tables(tables, freqs, self.stats), rotary_mode="interleave"),
            lambda out: self.class_check(x, out, *portable_tables(tables, freqs, self.stats)),
            lambda: check_scratch_bytes(x),
            x.device,
            stock=lambda: apply_portable(x, *portable_tables(tables, freqs, self.stats)),
        )

    def apply(
        self, x: torch.Tensor, tables: Tables, freqs: torch.Tensor, rope: nn.Module, inplace: bool = False
    ) -> torch.Tensor:
        """``rope(x, cos, sin)`` of stock with ``tables`` (of ``freqs``), on the backend the class docstring names.
        ``inplace``: the caller owns ``x`` and no longer needs it, so the portable math rotates it in place."""
        fn = self.kernel_for(x)
        if fn is not None:
            b, _, n, d = x.shape
            if freqs.shape[-1] * 2 == d and b * n < KERNEL_BN_LIMIT and x.dtype in KERNEL_DTYPES:
                out = self._kernel(fn, x, tables, freqs)
                if out is not None:
                    self.stats["kernel_calls"] += 1
                    return out
        if native_equivalent(rope):
            cos, sin_signed = portable_tables(tables, freqs, self.stats)
            self.stats["portable_calls"] += 1
            return (apply_portable_ if inplace else apply_portable)(x, cos, sin_signed)
        cos, sin = half_tables(tables, freqs, self.stats)
        self.stats["delegate_calls"] += 1
        return rope(x, cos, sin)

    def warm(self, x: torch.Tensor, freqs: torch.Tensor) -> bool | None:
        """Check the class of ``x`` now (``warmup``), as its first real call would: the verdict, or None."""
        fn = self.kernel_for(x)
        if fn is not None and self.settled(shape_class(x)) is None:
            self._kernel(fn, x, Tables(x.dtype), freqs)
        return None if fn is None else self.settled(shape_class(x))


#: The rotary service ``rope`` offers while installed (None: rotate with the portable math).
ROTARY: Slot[RotaryPath] = Slot("rotary")
