"""The verified ``torch_npu.npu_rotary_mul`` path, written once: its checks and the rotary service that runs it.

Why here: ``rope`` owns the NPU rotary path (its table cache, kernel verdicts, policy and statistics), and
``joint_attention`` rotates its joint q/k through the same path when ``rope`` is installed. Optimizations never
import each other, so ``rope`` switches the path on and off here (:func:`switch_on`, :func:`switch_off`);
``joint_attention`` asks :func:`active` and otherwise rotates with the portable math of :mod:`.rope_tables`.

How the kernel is verified (before it is used, and again where it runs):

1. :func:`verify_kernel`, once per (device, dtype, head_dim), on small random BSND inputs against the fp32 portable
   reference (see :data:`TOLERANCE_EPS_FACTOR`): a kernel that pairs halves (``npu_apply_rotary_pos_emb``, or the
   pre-7.0 aclops fallback that ignored ``rotary_mode``) fails by orders of magnitude and is refused;
2. :func:`verify_at_shape`, on the first real call of each :func:`shape_class`: the kernel's output on the real
   inputs against an fp32 reference; the class keeps the kernel only if it is within the tolerance and its max error
   is no larger than stock's own. A call that raises a TypeError/ValueError refuses its class; an error of the moment
   (out of memory, a runtime error) is a fault (:mod:`.guard`): that call takes the portable path, the class is
   retried after the guard's backoff.

Both kinds of verdict live in :class:`~.verdicts.VerdictCache` objects (a new backend probe drops them;
:meth:`RotaryKernel.clear` on ``rope``'s uninstall). :class:`RotaryKernel` counts into its owner's statistics, so
``rope``'s counters include the kernel calls ``joint_attention`` makes through it.
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn as nn

from vllm_omni_ascend_opt import _backend
from vllm_omni_ascend_opt.blocks.kernels.guard import Guard, bucket, is_error
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
from vllm_omni_ascend_opt.blocks.kernels.verdicts import VerdictCache

logger = logging.getLogger("vllm_omni_ascend_opt")

#: The kernel policy's environment variable (read by ``rope``; named in the refusals it causes).
ENV_KERNEL_POLICY = "VLLM_OMNI_ASCEND_OPT_ROPE_KERNEL"
#: Verification bound, per element: |kernel - ref_fp32| <= K * eps(dtype) * (|x*cos| + |swap(x)*sin|), K = 2.
#: Why: a kernel computing in fp32 and rounding once errs by <= u = eps/2 of that sum; stock's three roundings in the
#: activation dtype (mul, mul, add) err by up to ~2u of it. K*eps = 4u therefore accepts any correct kernel with 2x
#: headroom over stock's own worst case, while a wrong pairing errs by O(|x|) (relative error ~1: ~60x the bound for
#: bf16, ~10^7x for fp32) and an fp16-internal kernel on fp32 inputs errs by ~2^-11 relative (~2000x the fp32 bound).
#: The reference is fp32 math on the same (rounded) inputs and tables.
TOLERANCE_EPS_FACTOR = 2.0
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # npu_rotary_mul doc: fp16/bf16/fp32
KERNEL_D_LIMIT = 896  # npu_rotary_mul doc: D < 896 and even
KERNEL_BN_LIMIT = 1000  # npu_rotary_mul doc, interleave: B * N < 1000
#: Shape-class verification: chunk the fp32 reference over S so that one chunk holds at most this many elements.
VERIFY_CHUNK_ELEMS = 1 << 22
#: fp32 chunk-sized temporaries alive at once in :func:`verify_at_shape` (x, out, ref, scale, err, stock, swap).
_CHECK_TEMPS = 8


def check_scratch_bytes(x: torch.Tensor) -> int:
    """Device scratch of :func:`verify_at_shape` on ``x``: a few fp32 chunks of at most :data:`VERIFY_CHUNK_ELEMS`."""
    b, s, n, d = x.shape
    step = max(1, VERIFY_CHUNK_ELEMS // max(1, b * n * d))
    return _CHECK_TEMPS * 4 * b * min(s, step) * n * d


def reference_fp32(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The portable math in fp32 on the same inputs, and ``|x*cos| + |swap(x)*sin|`` (the error scale)."""
    x32, c32, s32 = x.float(), cos.float(), sin_signed.float()
    a, b = x32 * c32, swap_pairs(x32) * s32
    return a + b, a.abs() + b.abs()


# ----- verification of npu_rotary_mul ---------------------------------------------------------------------------
@dataclass
class KernelVerdict:
    """Outcome of verifying ``npu_rotary_mul`` for one (device, dtype, head_dim)."""

    device: str
    dtype: torch.dtype
    head_dim: int
    ok: bool
    reason: str = ""
    max_err_over_bound: float = math.nan
    bitwise_vs_stock: bool = False
    fn: Callable[..., torch.Tensor] | None = None
    err_kernel: float = math.nan  # max |kernel - ref_fp32|
    err_stock: float = math.nan  # max |stock - ref_fp32| (stock's own error in this dtype)

    def describe(self) -> str:
        where = f"{self.device}/{str(self.dtype).removeprefix('torch.')}/D={self.head_dim}"
        if self.ok:
            return (
                f"npu_rotary_mul(interleave) verified on {where}: in use (max error {self.max_err_over_bound:.3g} "
                f"of the bound {TOLERANCE_EPS_FACTOR:g}*eps*(|x*cos|+|rot(x)*sin|); bitwise equal to stock math: "
                f"{'yes' if self.bitwise_vs_stock else 'no'})"
            )
        return f"npu_rotary_mul(interleave) refused on {where}: {self.reason}; the portable path is used"


def verify_kernel(
    kernel: Callable[..., torch.Tensor], device: torch.device, dtype: torch.dtype, head_dim: int, num_heads: int
) -> KernelVerdict:
    """Run ``kernel`` and the portable reference on small random inputs of the real layout (BSND) and dtype."""
    v = KernelVerdict(str(device), dtype, head_dim, ok=False)
    if dtype not in KERNEL_DTYPES:
        v.reason = f"dtype {dtype} is not supported by npu_rotary_mul"
        return v
    if head_dim % 2 or head_dim >= KERNEL_D_LIMIT:
        v.reason = f"head_dim {head_dim} is not even and < {KERNEL_D_LIMIT}"
        return v
    g = torch.Generator().manual_seed(0x5EED)
    b, s, n, d = 2, 37, max(1, min(num_heads, 8)), head_dim
    x = (torch.randn(b, s, n, d, generator=g) * 3.0).to(dtype)
    theta = torch.rand(s, d // 2, generator=g, dtype=torch.float64) * (2 * math.pi * 64)
    freqs = torch.polar(torch.ones_like(theta), theta).to(torch.complex64)
    try:
        x, freqs = x.to(device), freqs.to(device)
        tables = Tables(dtype)
        scratch: Counter = Counter()
        cos, sin_signed = portable_tables(tables, freqs, scratch)
        ncos, nsin = npu_tables(tables, freqs, scratch)
        out = kernel(x, ncos, nsin, rotary_mode="interleave")
    except Exception as exc:
        if is_error(exc):  # out of memory, a runtime error: a fault, for the guard (not a verdict)
            raise
        v.reason = f"the kernel raised {exc.__class__.__name__}: {exc}"
        return v
    if not isinstance(out, torch.Tensor) or out.shape != x.shape or out.dtype != dtype or out.device != x.device:
        got = (getattr(out, "shape", None), getattr(out, "dtype", None), getattr(out, "device", None))
        v.reason = f"wrong output (shape, dtype, device) {got}, expected {(x.shape, dtype, x.device)}"
        return v
    stock = apply_portable(x, cos, sin_signed)
    ratio, err_k, err_s = _errors(x, out, stock, cos, sin_signed)
    v.max_err_over_bound, v.err_kernel, v.err_stock = ratio, err_k, err_s
    v.bitwise_vs_stock = bool(torch.equal(out, stock))
    why = _judge(ratio, err_k, err_s)
    if why:
        v.reason = why + "; wrong pairing mode or precision"
        return v
    v.ok, v.fn = True, kernel
    return v


def _errors(
    x: torch.Tensor, out: torch.Tensor, stock: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor
) -> tuple[float, float, float]:
    """(max error / bound, max |out - ref_fp32|, max |stock - ref_fp32|) for one chunk; inf when out is not finite."""
    ref, scale = reference_fp32(x, cos, sin_signed)
    if not bool(torch.isfinite(out).all()):
        return math.inf, math.inf, float((stock.float() - ref).abs().max())
    err = (out.float() - ref).abs()
    bound = TOLERANCE_EPS_FACTOR * torch.finfo(x.dtype).eps * scale + torch.finfo(torch.float32).tiny
    return float((err / bound).max()), float(err.max()), float((stock.float() - ref).abs().max())


def _judge(ratio: float, err_kernel: float, err_stock: float) -> str:
    """Why the kernel's errors are unacceptable ("" when they are acceptable)."""
    if not ratio <= 1.0:
        return (
            f"output differs from the fp32 reference by up to {ratio:.3g}x the tolerance "
            f"({TOLERANCE_EPS_FACTOR:g}*eps*(|x*cos|+|rot(x)*sin|))"
        )
    if not err_kernel <= err_stock:
        return (
            f"max error {err_kernel:.3g} against the fp32 reference exceeds stock's own {err_stock:.3g} in this dtype"
        )
    return ""


def shape_class(x: torch.Tensor) -> tuple[str, torch.dtype, str, int, int, int]:
    """(device, dtype, layout, B*N bucket, sequence-length bucket, D) of a BSND input: what a kernel tiling depends on.

    B*N is bucketed like S (next power of two): the kernel spreads B*N*S rows over its cores in tiles, so within a
    power-of-two range it runs the same tiling code with another tile count, and a class checked at one size in the
    range stands for the others. That makes CFG's batch of 2 and a sequence-parallel split of the heads (24 heads at
    B=1, 12 per rank at B=2) share classes, instead of each being checked (and saved) on its own."""
    b, s, n, d = x.shape
    return (str(x.device), x.dtype, "BSND", bucket(b * n), bucket(s), d)


@dataclass
class ShapeVerdict:
    """Outcome of checking the kernel on the first real call of one shape class."""

    key: tuple[str, torch.dtype, str, int, int, int]
    ok: bool
    reason: str = ""
    max_err_over_bound: float = math.nan
    err_kernel: float = math.nan
    err_stock: float = math.nan
    bitwise_vs_stock: bool = False
    seconds: float = 0.0

    def describe(self) -> str:
        dev, dtype, layout, bn, bucket, d = self.key
        where = f"{dev}/{str(dtype).removeprefix('torch.')}/{layout} B*N<={bn} S<={bucket} D={d}"
        if self.ok:
            return (
                f"npu_rotary_mul at {where}: in use (max error {self.err_kernel:.3g} vs stock's {self.err_stock:.3g}, "
                f"{self.max_err_over_bound:.3g} of the bound; bitwise equal to stock: "
                f"{'yes' if self.bitwise_vs_stock else 'no'}; check took {self.seconds * 1e3:.1f} ms)"
            )
        return f"npu_rotary_mul at {where}: refused ({self.reason}); the portable path is used for this shape class"


def verify_at_shape(
    x: torch.Tensor, out: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor, *, bitwise: bool
) -> ShapeVerdict:
    """Check the kernel's ``out`` for the real BSND ``x`` against an fp32 reference computed in chunks over S (one
    chunk of at most :data:`VERIFY_CHUNK_ELEMS` fp32 elements at a time, whatever S and B*N are). ``cos`` /
    ``sin_signed``: the portable [S, 1, D] tables of this call."""
    t0 = time.perf_counter()
    v = ShapeVerdict(shape_class(x), ok=False)
    if out.shape != x.shape or out.dtype != x.dtype or out.device != x.device:
        v.reason = f"wrong output {tuple(out.shape)} {out.dtype} {out.device}"
        return v
    b, s, n, d = x.shape
    step = max(1, VERIFY_CHUNK_ELEMS // max(1, b * n * d))
    ratio, err_k, err_s, same = 0.0, 0.0, 0.0, True
    for i in range(0, s, step):
        xc, oc, cc, sc = x[:, i : i + step], out[:, i : i + step], cos[i : i + step], sin_signed[i : i + step]
        stock = apply_portable(xc, cc, sc)
        r, ek, es = _errors(xc, oc, stock, cc, sc)
        ratio, err_k, err_s = max(ratio, r), max(err_k, ek), max(err_s, es)
        same = same and bool(torch.equal(oc, stock))
    v.max_err_over_bound, v.err_kernel, v.err_stock, v.bitwise_vs_stock = ratio, err_k, err_s, same
    v.reason = _judge(ratio, err_k, err_s)
    if not v.reason and bitwise and not same:
        v.reason = f"not bitwise-equal to stock at this shape and the policy is bitwise ({ENV_KERNEL_POLICY})"
    v.ok = not v.reason
    _backend.synchronize(x.device if x.device.type != "cpu" else None)
    v.seconds = time.perf_counter() - t0
    return v


# ----- the rotary service ---------------------------------------------------------------------------------------
class KernelPolicy(Protocol):
    """What the owner of a :class:`RotaryKernel` decides (``rope``): whether the NPU kernel may be tried, and whether
    only a kernel bitwise-equal to stock is accepted."""

    use_npu_kernel: bool

    def requires_bitwise(self) -> bool: ...


class RotaryKernel:
    """Cached tables and the backend choice for one owner: the verified ``npu_rotary_mul``, else the portable math
    (where stock runs ``forward_native``), else stock's own rotary kernel with cached tables.

    Counts into ``stats`` (the owner's): ``table_builds`` / ``table_hits``, ``kernel_calls``, ``portable_calls``,
    ``delegate_calls``, ``shape_checks``. Logs each verdict once, prefixed with ``label``."""

    def __init__(self, policy: KernelPolicy, stats: Counter, label: str) -> None:
        self.policy = policy
        self.stats = stats
        self.label = label
        self.tables = TableCache(stats)
        #: Per (device, dtype, head_dim): the toy-shape verification; per :func:`shape_class`: the check on the
        #: first real call of the class. Both saved on disk (:mod:`.saved`); a saved pass is not taken under the
        #: bitwise policy (whether it was bitwise is not saved): the check runs.
        self.verdicts: VerdictCache[KernelVerdict] = VerdictCache("npu_rotary_mul.toy", self._saved_toy)
        self.shapes: VerdictCache[ShapeVerdict] = VerdictCache("npu_rotary_mul", self._saved_shape)
        #: Faults of the checks and kernel calls (both kinds of key), retried with backoff.
        self.guard = Guard(label, stats)

    def _saved_toy(self, key: Any, ok: bool, reason: str) -> KernelVerdict | None:
        if ok and self.policy.requires_bitwise():
            return None
        fn = getattr(_backend.torch_npu_module(), "npu_rotary_mul", None)
        return KernelVerdict(key[0], key[1], key[2], ok=ok and fn is not None, reason=reason, fn=fn if ok else None)

    def _saved_shape(self, key: Any, ok: bool, reason: str) -> ShapeVerdict | None:
        if ok and self.policy.requires_bitwise():
            return None
        return ShapeVerdict(key, ok=ok, reason=reason or "saved verdict")

    def clear(self) -> None:
        """Drop tables, verdicts and faults."""
        self.guard.clear()
        self.tables.clear()
        self.verdicts.clear()
        self.shapes.clear()

    def _log(self, ok: bool, what: str) -> None:
        (logger.info if ok else logger.warning)("vllm-omni-ascend-opt: %s: %s", self.label, what)

    def kernel_for(self, x: torch.Tensor) -> KernelVerdict | None:
        """The verified ``npu_rotary_mul`` verdict for ``x``'s (device, dtype, head_dim), or None (no kernel here,
        or its first-use check faulted: retried after the guard's backoff)."""
        if not self.policy.use_npu_kernel:
            return None
        mod = _backend.torch_npu_module()
        if mod is None:
            return None
        key = (str(x.device), x.dtype, x.shape[-1])
        v = self.verdicts.get(key)
        if v is None:
            if self.guard.waits(key):
                return None
            kernel = getattr(mod, "npu_rotary_mul", None)
            if kernel is None:
                v = KernelVerdict(key[0], x.dtype, x.shape[-1], ok=False, reason="torch_npu has no npu_rotary_mul")
            else:
                ran, v, refusal = self.guard.run(
                    key, lambda: verify_kernel(kernel, x.device, x.dtype, x.shape[-1], x.shape[2])
                )
                if not ran:
                    if not refusal:
                        return None  # a fault: recorded by the guard, retried later
                    v = KernelVerdict(key[0], x.dtype, x.shape[-1], ok=False, reason=refusal)
                assert v is not None
                if v.ok and self.policy.requires_bitwise() and not v.bitwise_vs_stock:
                    v.ok, v.fn = False, None
                    v.reason = (
                        f"within tolerance but not bitwise-equal to stock math, and {ENV_KERNEL_POLICY}=bitwise "
                        "keeps rope in the exact tier: the portable path is used (the default policy 'pixel' "
                        "accepts it)"
                    )
            self.verdicts.put(key, v)
            self._log(v.ok, v.describe())
        return v if v.ok else None

    def _kernel_call(
        self, fn: Callable[..., torch.Tensor], x: torch.Tensor, tables: Tables, freqs: torch.Tensor, checked: bool
    ) -> torch.Tensor | None:
        """The kernel on ``x`` (and, on the first call of its class, the check): its output, or None when the class
        was refused here (the verdict is stored). Runs inside the guard: whatever it raises costs this call only."""
        key = shape_class(x)
        cos, sin = npu_tables(tables, freqs, self.stats)
        if not checked and not self.guard.fits(key, x.device, check_scratch_bytes(x)):
            return None  # deferred: stock now, the check later
        out = fn(x, cos, sin, rotary_mode="interleave")
        if checked:
            return out
        pc, ps = portable_tables(tables, freqs, self.stats)
        v = verify_at_shape(x, out, pc, ps, bitwise=self.policy.requires_bitwise())
        usable = self.shapes.put(key, v).ok  # under several ranks a pass waits for the others (agree.py)
        self.stats["shape_checks"] += 1
        self._log(v.ok, v.describe())
        return out if usable else None

    def apply(
        self, x: torch.Tensor, tables: Tables, freqs: torch.Tensor, rope: nn.Module, inplace: bool = False
    ) -> torch.Tensor:
        """``rope(x, cos, sin)`` of stock with ``tables`` (of ``freqs``), on the backend the class docstring names
        (the kernel only where its shape class passed). ``inplace``: the caller owns ``x`` and no longer needs it, so
        the portable math rotates it in place (fewer temporaries); the other paths return new tensors. The kernel
        call and its check run inside :attr:`guard`: a fault sends this call to the portable path."""
        verdict = self.kernel_for(x)
        if verdict is not None:
            b, _, n, d = x.shape
            key = shape_class(x)
            checked = self.shapes.get(key)
            eligible = freqs.shape[-1] * 2 == d and b * n < KERNEL_BN_LIMIT and x.dtype in KERNEL_DTYPES
            if eligible and (checked is None or checked.ok) and not self.guard.waits(key):
                fn = verdict.fn
                assert fn is not None
                ran, out, refusal = self.guard.run(
                    key, lambda: self._kernel_call(fn, x, tables, freqs, checked is not None)
                )
                if refusal:
                    self._log(False, self.shapes.put(key, ShapeVerdict(key, ok=False, reason=refusal)).describe())
                elif ran and out is not None:
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
        """Check the kernel's class of ``x`` now (``warmup``), as its first real call would: the verdict (ok), or
        None when there is no kernel here or the check faulted or was deferred. A class already decided is not
        checked again."""
        verdict = self.kernel_for(x)
        if verdict is None or verdict.fn is None:
            return None
        key = shape_class(x)
        checked = self.shapes.get(key)
        if checked is None and not self.guard.waits(key):
            fn = verdict.fn
            self.guard.run(key, lambda: self._kernel_call(fn, x, Tables(x.dtype), freqs, False))
            checked = self.shapes.get(key)
        return None if checked is None else checked.ok

    def rotate(self, x: torch.Tensor, freqs: torch.Tensor, rope: nn.Module) -> torch.Tensor:
        """:meth:`apply` with the cached tables of ``freqs`` in ``x``'s dtype."""
        return self.apply(x, self.tables.get(freqs, x.dtype), freqs, rope)


_ACTIVE: list[RotaryKernel] = []


def switch_on(kernel: RotaryKernel) -> None:
    """Make ``kernel`` the rotary path other users take (``rope``'s install)."""
    _ACTIVE[:] = [kernel]


def switch_off(kernel: RotaryKernel) -> None:
    """Stop offering ``kernel`` (``rope``'s uninstall); a no-op when another one is active."""
    if _ACTIVE and _ACTIVE[0] is kernel:
        _ACTIVE.clear()


def active() -> RotaryKernel | None:
    """The rotary path switched on (``rope`` installed), or None: the caller rotates with the portable math."""
    return _ACTIVE[0] if _ACTIVE else None
