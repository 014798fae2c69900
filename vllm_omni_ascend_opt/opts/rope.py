"""`rope`: Build RoPE cos/sin tables once per forward shape and reuse them in every block; on Ascend apply them with a verified torch_npu.npu_rotary_mul (interleave).

Patch header (vllm-ascend ``vllm_ascend/patch/`` style)
-------------------------------------------------------
Patched symbols (``vllm_omni/diffusion/models/qwen_image/qwen_image_transformer.py``, vLLM-Omni 0.30.x):

* module global ``_qwen_image_qk_norm_rope`` (looked up at call time by ``QwenImageCrossAttention.forward``, so the
  patch also reaches models built before it was installed, TeaCache's block loop and SP-sharded freqs);
* ``QwenEmbedRope.forward`` and ``QwenEmbedLayer3DRope.forward``: memoized per (shapes, text lengths, device, tables).

Why: stock converts the complex freqs to ``cos``/``sin`` (``torch.real(freqs).to(dtype)``, ``torch.imag(...)``) in
every block for img and txt, and ``RotaryEmbedding.forward_native`` then re-expands them (einops ``repeat``) and
negates/stacks ``x`` on every call: 10 kernel launches per q/k, 40 per block. On Ascend without MindIE-SD that is
also the path taken (``forward_npu`` falls back to ``forward_native``).

How:

* Tables: built once per freqs tensor and dtype, cached on the freqs tensor's identity (weak reference, so an entry
  dies with its freqs; plus storage offset, shape, stride, dtype, device and, where tracked, ``_version``). The same
  vid/txt freqs objects are passed to every block of a forward, and the ``QwenEmbedRope`` memo returns the same
  objects for the same (image shapes, text lengths, device, ``pos_freqs``/``neg_freqs`` objects) across steps and
  requests, so tables are built once per shape. Under sequence parallel the blocks see this rank's (padded) shard -
  a different tensor - so ranks and paddings never share a table.
* Portable path (any device where stock runs ``forward_native``): ``x * cos + swap(x) * sin_signed`` with
  ``cos`` = repeat-interleaved cos and ``sin_signed`` = (-s, s) interleaved, ``swap`` = adjacent pairs swapped
  (one ``stack``). Each element sees exactly stock's operations in stock's order ((-a)*b == a*(-b) in IEEE
  arithmetic), so results are bitwise identical: 4 launches per q/k instead of 10.
* Where stock dispatches to another kernel (MindIE-SD, CUDA), that kernel is called with cached cos/sin: exact.
* NPU path: ``torch_npu.npu_rotary_mul(x, cos, sin, rotary_mode="interleave")`` with cos/sin repeat-interleaved to
  (1, S, 1, D) (class 1S1D for BSND, the only one interleave accepts): 1 launch per q/k. It is verified twice:
  (1) once per (device, dtype, head_dim) on small random BSND inputs against the fp32 portable reference (see
  :data:`TOLERANCE_EPS_FACTOR`): a kernel that pairs halves (``npu_apply_rotary_pos_emb``, or the pre-7.0 aclops
  fallback that ignored ``rotary_mode``; since op-plugin 7.0 that fallback raises for interleave) fails by orders of
  magnitude and is refused; (2) on the first real call of each *shape class* (device, dtype, layout BSND, B*N,
  sequence-length bucket = next power of two, D) the kernel's output on the real inputs is compared with an fp32
  reference computed in chunks over S (bounded memory, :data:`VERIFY_CHUNK_ELEMS`); the class keeps the kernel only
  if it is within the tolerance and its max error is no larger than stock's own (the portable path, stock's
  roundings, on the same chunks). Different tilings at production shapes (S ~ 4352, B*N 24-48) are thus checked
  where they run; a call that raises falls back to the portable path for that class, with the reason logged.
* Tier: the kernel computes in fp32 and rounds once, so it is not bitwise-equal to stock's three bf16 roundings;
  with it ``rope`` delivers the ``pixel`` tier (uint8-identical images, float outputs may differ - what the
  reference 910B1 work kept it for), without it ``exact``. Policy ``VLLM_OMNI_ASCEND_OPT_ROPE_KERNEL``: ``pixel``
  (default; ``verified`` is an alias) uses the verified kernel; ``bitwise`` uses it only where it is bitwise-equal
  to stock on the verification inputs (an unknown value keeps ``bitwise`` and says so). ``Rope.tier()`` reports the
  tier delivered here (``list``, ``status()``, the ablation gates). The RMSNorm before RoPE stays stock (no exact
  fused replacement exists).

Upstream PR: vllm-omni #4043 (open) calls ``npu_rotary_mul`` in ``RotaryEmbedding.forward_npu``; table reuse is not
proposed upstream yet.
Removal plan: drop when vLLM-Omni builds cos/sin once per forward for Qwen-Image and its NPU RoPE uses
``npu_rotary_mul(..., rotary_mode="interleave")`` verified on device.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import time
import weakref
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn as nn

from vllm_omni_ascend_opt import _backend
from vllm_omni_ascend_opt.blocks import targets as _targets
from vllm_omni_ascend_opt.optimization import Optimization

ENV_KERNEL_POLICY = "VLLM_OMNI_ASCEND_OPT_ROPE_KERNEL"
logger = logging.getLogger("vllm_omni_ascend_opt")

#: Verification bound, per element: |kernel - ref_fp32| <= K * eps(dtype) * (|x*cos| + |swap(x)*sin|), K = 2.
#: Why: a kernel computing in fp32 and rounding once errs by <= u = eps/2 of that sum; stock's three roundings in the
#: activation dtype (mul, mul, add) err by up to ~2u of it. K*eps = 4u therefore accepts any correct kernel with 2x
#: headroom over stock's own worst case, while a wrong pairing errs by O(|x|) (relative error ~1: ~60x the bound for
#: bf16, ~10^7x for fp32; measured through the fake: 4.9e3x / 3.2e8x) and an fp16-internal kernel on fp32 inputs errs
#: by ~2^-11 relative (~2000x the fp32 bound; measured 6.1e3x). The reference is fp32 math on the same (rounded)
#: inputs and tables.
TOLERANCE_EPS_FACTOR = 2.0
_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # npu_rotary_mul doc: fp16/bf16/fp32
_KERNEL_D_LIMIT = 896  # npu_rotary_mul doc: D < 896 and even
_KERNEL_BN_LIMIT = 1000  # npu_rotary_mul doc, interleave: B * N < 1000
#: Shape-class verification: chunk the fp32 reference over S so that one chunk holds at most this many elements.
VERIFY_CHUNK_ELEMS = 1 << 22
#: Kernel policies (``VLLM_OMNI_ASCEND_OPT_ROPE_KERNEL``); "verified" is the pre-tier name of "pixel".
POLICIES = ("pixel", "verified", "bitwise")
_TABLE_CACHE_SIZE = 32
_EMBED_MEMO_SIZE = 8


# ----------------------------------------------------------------------------------------------------------------
# tables
# ----------------------------------------------------------------------------------------------------------------
class _Tables:
    """cos/sin for one freqs tensor and dtype, built lazily in the forms each path needs."""

    __slots__ = ("cos", "dtype", "half_cos", "half_sin", "npu_cos", "npu_sin", "sin_signed")

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.half_cos: torch.Tensor | None = None  # stock's cos: real(freqs).to(dtype), [S, D/2]
        self.half_sin: torch.Tensor | None = None
        self.cos: torch.Tensor | None = None  # [S, 1, D], repeat-interleaved (portable and, as [1,S,1,D], NPU)
        self.sin_signed: torch.Tensor | None = None  # [S, 1, D]: (-s0, s0, -s1, s1, ...)
        self.npu_cos: torch.Tensor | None = None  # [1, S, 1, D]
        self.npu_sin: torch.Tensor | None = None  # [1, S, 1, D]: (s0, s0, s1, s1, ...)


def _half_tables(t: _Tables, freqs: torch.Tensor, stats: Counter) -> tuple[torch.Tensor, torch.Tensor]:
    if t.half_cos is None:
        # Exactly stock's conversion (copied when it is a view of freqs, so the cache never pins freqs' storage).
        cos = torch.real(freqs).to(t.dtype)
        sin = torch.imag(freqs).to(t.dtype)
        if cos.data_ptr() == freqs.data_ptr() or cos._base is not None:
            cos, sin = cos.clone(), sin.clone()
        t.half_cos, t.half_sin = cos, sin
        stats["table_builds"] += 1
    return t.half_cos, t.half_sin  # type: ignore[return-value]


def _portable_tables(t: _Tables, freqs: torch.Tensor, stats: Counter) -> tuple[torch.Tensor, torch.Tensor]:
    if t.cos is None:
        c, s = _half_tables(t, freqs, stats)
        # Same values as stock's einops ``repeat(c, "... d -> ... 1 (d 2)")``.
        t.cos = torch.repeat_interleave(c, 2, dim=-1).unsqueeze(-2)
        t.sin_signed = torch.stack((-s, s), dim=-1).flatten(-2).unsqueeze(-2)
    return t.cos, t.sin_signed  # type: ignore[return-value]


def _npu_tables(t: _Tables, freqs: torch.Tensor, stats: Counter) -> tuple[torch.Tensor, torch.Tensor]:
    if t.npu_sin is None:
        cos, _ = _portable_tables(t, freqs, stats)
        t.npu_cos = cos.unsqueeze(0)  # [1, S, 1, D] view of the portable table
        t.npu_sin = torch.repeat_interleave(t.half_sin, 2, dim=-1)[None, :, None, :]  # type: ignore[arg-type]
    return t.npu_cos, t.npu_sin  # type: ignore[return-value]


def _version_or_none(t: torch.Tensor) -> int | None:
    try:
        return t._version
    except RuntimeError:  # inference tensors do not track versions; upstream never writes freqs in place
        return None


class _TableCache:
    """Tables per freqs tensor (by identity, weakly) and dtype; bounded LRU; an entry dies with its freqs."""

    def __init__(self, stats: Counter) -> None:
        self._entries: OrderedDict[tuple, tuple[weakref.ref, _Tables]] = OrderedDict()
        self._stats = stats

    def clear(self) -> None:
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)

    def nbytes(self) -> int:
        """Bytes of every table held (each form built so far)."""
        return sum(
            t.numel() * t.element_size()
            for _ref, tables in self._entries.values()
            for name in _Tables.__slots__
            if isinstance(t := getattr(tables, name), torch.Tensor)
        )

    @staticmethod
    def _key(freqs: torch.Tensor, dtype: torch.dtype) -> tuple[tuple, torch.Tensor]:
        # A view of a live, versioned base (e.g. a rank's chunk of the full vid freqs, txt freqs sliced from
        # pos_freqs) is identified by base + geometry; anything else by its own identity.
        base = freqs._base
        root = base if base is not None else freqs
        key = (
            id(root),
            freqs.storage_offset(),
            tuple(freqs.shape),
            freqs.stride(),
            freqs.dtype,
            freqs.device,
            _version_or_none(freqs),
            dtype,
        )
        return key, root

    def get(self, freqs: torch.Tensor, dtype: torch.dtype) -> _Tables:
        key, root = self._key(freqs, dtype)
        hit = self._entries.get(key)
        if hit is not None and hit[0]() is root:
            self._entries.move_to_end(key)
            self._stats["table_hits"] += 1
            return hit[1]
        entries = self._entries

        def _drop(_ref: weakref.ref, key: tuple = key) -> None:
            entries.pop(key, None)

        tables = _Tables(dtype)
        entries[key] = (weakref.ref(root, _drop), tables)
        while len(entries) > _TABLE_CACHE_SIZE:
            entries.popitem(last=False)
        return tables


# ----------------------------------------------------------------------------------------------------------------
# rotary math
# ----------------------------------------------------------------------------------------------------------------
def _swap_pairs(x: torch.Tensor) -> torch.Tensor:
    """(x1, x0, x3, x2, ...): stock's interleaved ``rotate_half`` without its negation (folded into sin)."""
    return torch.stack((x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)


def apply_portable(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """Bitwise-equal to ``RotaryEmbedding(is_neox_style=False).forward_native(x, cos_half, sin_half)``.

    ``cos``/``sin_signed`` are [S, 1, rotary_dim] (see :func:`_portable_tables`); ``x`` is [B, S, N, D].
    """
    ro_dim = cos.shape[-1]
    if ro_dim == x.shape[-1]:
        return x * cos + _swap_pairs(x) * sin_signed
    xr = x[..., :ro_dim]
    return torch.cat([xr * cos + _swap_pairs(xr) * sin_signed, x[..., ro_dim:]], dim=-1)


def reference_fp32(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The same math in fp32 on the same inputs, and ``|x*cos| + |swap(x)*sin|`` (the error scale)."""
    x32, c32, s32 = x.float(), cos.float(), sin_signed.float()
    a, b = x32 * c32, _swap_pairs(x32) * s32
    return a + b, a.abs() + b.abs()


def _native_equivalent(rope: nn.Module) -> bool:
    """True when stock's ``rope(x, cos, sin)`` runs ``RotaryEmbedding.forward_native`` (interleaved, half-dim)."""
    mod = sys.modules.get("vllm_omni.diffusion.layers.rope")
    if mod is None:
        return False
    cls = mod.RotaryEmbedding
    if type(rope) is not cls or "forward" in rope.__dict__ or not rope.interleaved or not rope.half_head_dim:
        return False
    fm = getattr(rope, "_forward_method", None)
    if getattr(fm, "__self__", None) is not rope:
        return False
    func = getattr(fm, "__func__", None)
    if func is cls.forward_native:
        return True
    if func is cls.forward_npu:  # without MindIE-SD it is forward_native
        return not rope.has_mindie
    custom_op = sys.modules.get("vllm_omni.diffusion.layers.custom_op")
    return custom_op is not None and func is custom_op.CustomOp.forward_xpu  # calls forward_native


# ----------------------------------------------------------------------------------------------------------------
# on-device verification of npu_rotary_mul
# ----------------------------------------------------------------------------------------------------------------
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
    if dtype not in _KERNEL_DTYPES:
        v.reason = f"dtype {dtype} is not supported by npu_rotary_mul"
        return v
    if head_dim % 2 or head_dim >= _KERNEL_D_LIMIT:
        v.reason = f"head_dim {head_dim} is not even and < {_KERNEL_D_LIMIT}"
        return v
    g = torch.Generator().manual_seed(0x5EED)
    b, s, n, d = 2, 37, max(1, min(num_heads, 8)), head_dim
    x = (torch.randn(b, s, n, d, generator=g) * 3.0).to(dtype)
    theta = torch.rand(s, d // 2, generator=g, dtype=torch.float64) * (2 * math.pi * 64)
    freqs = torch.polar(torch.ones_like(theta), theta).to(torch.complex64)
    try:
        x, freqs = x.to(device), freqs.to(device)
        tables = _Tables(dtype)
        scratch: Counter = Counter()
        cos, sin_signed = _portable_tables(tables, freqs, scratch)
        npu_cos, npu_sin = _npu_tables(tables, freqs, scratch)
        out = kernel(x, npu_cos, npu_sin, rotary_mode="interleave")
    except Exception as exc:
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
    """(device, dtype, layout, B*N, sequence-length bucket, D) of a BSND input: what a kernel tiling depends on."""
    b, s, n, d = x.shape
    return (str(x.device), x.dtype, "BSND", b * n, 1 << max(0, (s - 1).bit_length()), d)


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
        where = f"{dev}/{str(dtype).removeprefix('torch.')}/{layout} B*N={bn} S<={bucket} D={d}"
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
    """Check the kernel's ``out`` for the real BSND ``x`` against an fp32 reference computed in chunks over S.

    ``cos``/``sin_signed`` are the portable [S, 1, D] tables of this call. Memory: one chunk of at most
    :data:`VERIFY_CHUNK_ELEMS` elements in fp32 (a few buffers of it), whatever S and B*N are."""
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


# ----------------------------------------------------------------------------------------------------------------
# the optimization
# ----------------------------------------------------------------------------------------------------------------
class Rope(Optimization):
    name = "rope"
    summary = "Build RoPE cos/sin tables once per forward shape and reuse them in every block; on Ascend apply them with a verified torch_npu.npu_rotary_mul (interleave)."
    #: exact on the portable path; pixel with the NPU kernel (see :meth:`tier`).
    equivalence = "pixel"
    default_enabled = True
    requires = ("vLLM-Omni 0.30.x; NPU kernel path: torch_npu with npu_rotary_mul rotary_mode='interleave'",)
    target_modules = (_targets.TRANSFORMER,)
    parallel_support: ClassVar[dict[str, str]] = {
        "single": "supported",
        # Tables are keyed on the freqs tensor each block receives: under Ulysses/Ring SP that is this rank's
        # (padded) shard, so ranks and paddings never share a table; TP only changes the head count.
        "ulysses": "supported",
        "ring": "supported",
        "cfg_parallel": "supported",
        "tensor_parallel": "supported",
        "allgather": "supported",
        "vae_patch_parallel": "supported",
    }
    regions = frozenset({"block", "transformer"})
    acts_without_attach = True
    removal_plan = (
        "Drop when vLLM-Omni builds Qwen-Image cos/sin once per forward and RotaryEmbedding.forward_npu calls "
        "npu_rotary_mul(rotary_mode='interleave') (vllm-omni PR #4043) verified on device."
    )

    #: Set False to keep the portable path even where torch_npu is present.
    use_npu_kernel: bool = True
    #: Accept the NPU kernel only if it is bitwise-equal to stock's math (keeps ``rope`` in the ``exact`` tier).
    #: None (default): from ``VLLM_OMNI_ASCEND_OPT_ROPE_KERNEL`` (``pixel``, the default, or ``bitwise``), read when
    #: the kernel is verified; True/False override it.
    require_bitwise_kernel: bool | None = None

    def __init__(self) -> None:
        super().__init__()
        self.stats: Counter[str] = Counter()
        self._tables = _TableCache(self.stats)
        self._verdicts: dict[tuple[str, torch.dtype, int], KernelVerdict] = {}
        self._shapes: dict[tuple, ShapeVerdict] = {}
        self._verdict_mod: Any = None
        self._embed_memo: weakref.WeakKeyDictionary[nn.Module, OrderedDict] = weakref.WeakKeyDictionary()
        self._bad_policy: set[str] = set()

    # ----- reporting -----------------------------------------------------------------------------------------
    def _process_reasons(self) -> list[str]:
        return []  # the portable path runs everywhere vLLM-Omni does

    def cache_memory(self) -> dict[str, Any]:
        return {"tables": len(self._tables), "table_cap": _TABLE_CACHE_SIZE, "bytes": self._tables.nbytes()}

    def _model_reasons(self, model: nn.Module) -> list[str]:
        mod = sys.modules.get(_targets.TRANSFORMER)
        transformer = getattr(model, "transformer", model)
        if mod is None or not isinstance(transformer, mod.QwenImageTransformer2DModel):
            return ["no QwenImageTransformer2DModel in this model: rope only changes Qwen-Image's RoPE"]
        return []

    def tier(self) -> str:
        """``pixel`` where the NPU kernel is (or, once verified, will be) used; ``exact`` on the portable path."""
        return "pixel" if self._kernel_may_run() else "exact"

    def _kernel_may_run(self) -> bool:
        mod = _backend.torch_npu_module()
        if not self.use_npu_kernel or mod is None or getattr(mod, "npu_rotary_mul", None) is None:
            return False
        if self.requires_bitwise():
            return False  # only a bitwise-equal kernel is taken: exact either way
        verdicts = list(self._verdicts.values()) if self._verdict_mod is mod else []
        shapes = list(self._shapes.values()) if self._verdict_mod is mod else []
        if verdicts and not any(v.ok for v in verdicts):
            return False
        return not shapes or any(v.ok for v in shapes)

    def notes(self) -> list[str]:
        out = [
            f"{ENV_KERNEL_POLICY}={v!r} is not one of {', '.join(POLICIES)}: the 'bitwise' policy is used"
            for v in sorted(self._bad_policy)
        ]
        out.append(
            f"tier here: {self.tier()} (exact: portable path, bitwise stock; pixel: npu_rotary_mul, fp32 inside, "
            f"uint8-identical images); kernel policy {'bitwise' if self.requires_bitwise() else 'pixel'}"
        )
        mod = _backend.torch_npu_module()
        if mod is None:
            why = "; ".join(_backend.npu_unavailable_reasons()) or "torch_npu unavailable"
            out.append(
                f"NPU kernel npu_rotary_mul not in use: {why}. Portable path: cached cos/sin tables with vLLM-Omni's "
                "own rotary math, bitwise-identical to stock."
            )
        elif not self.use_npu_kernel:
            out.append("NPU kernel npu_rotary_mul disabled (Rope.use_npu_kernel=False); portable path in use.")
        else:
            verdicts = list(self._verdicts.values()) if self._verdict_mod is mod else []
            if not verdicts:
                out.append(
                    "torch_npu present: npu_rotary_mul(interleave) will be verified against the fp32 portable "
                    "reference on first use per (device, dtype, head_dim), and again on the first real call of each "
                    "shape class (dtype, layout, B*N, S bucket), before it is used."
                )
            out.extend(v.describe() for v in verdicts)
            if self._verdict_mod is mod:
                out.extend(v.describe() for v in self._shapes.values())
        if self.stats:
            s = self.stats
            out.append(
                f"tables built {s['table_builds']}, reused {s['table_hits']}; shape memo hits {s['embed_memo_hits']}; "
                f"rotary calls: npu {s['kernel_calls']}, portable {s['portable_calls']}, "
                f"stock kernel with cached tables {s['delegate_calls']}, stock {s['stock_calls']}"
            )
        return out

    def verdicts(self) -> list[KernelVerdict]:
        return list(self._verdicts.values())

    def shape_verdicts(self) -> list[ShapeVerdict]:
        """The per-shape-class checks of the kernel on real calls so far."""
        return list(self._shapes.values())

    # ----- install -------------------------------------------------------------------------------------------
    def _install(self) -> None:
        mod = sys.modules[_targets.TRANSFORMER]
        self.patches.set(mod, "_qwen_image_qk_norm_rope", self._make_qk_norm_rope(mod._qwen_image_qk_norm_rope))
        for cls_name in ("QwenEmbedRope", "QwenEmbedLayer3DRope"):
            cls = getattr(mod, cls_name, None)
            if cls is not None:
                self.patches.set(cls, "forward", self._make_embed_forward(cls.forward))

    def _uninstall(self) -> None:
        self.reset_state()

    def reset_state(self) -> None:
        """Drop tables, shape memos, kernel verdicts and counters."""
        self._tables.clear()
        self._embed_memo.clear()
        self._verdicts.clear()
        self._shapes.clear()
        self._verdict_mod = None
        self.stats.clear()
        self._bad_policy.clear()

    def requires_bitwise(self) -> bool:
        """The kernel policy: the explicit attribute, else ``VLLM_OMNI_ASCEND_OPT_ROPE_KERNEL`` (default ``pixel``).

        An unknown value keeps the safe ``bitwise`` policy and is logged and shown in ``notes()``."""
        if self.require_bitwise_kernel is not None:
            return self.require_bitwise_kernel
        raw = os.environ.get(ENV_KERNEL_POLICY, "pixel").strip().lower()
        if raw not in POLICIES:
            if raw not in self._bad_policy:
                logger.warning(
                    "vllm-omni-ascend-opt: rope: %s=%r is not one of %s; using 'bitwise'",
                    ENV_KERNEL_POLICY,
                    raw,
                    ", ".join(POLICIES),
                )
                self._bad_policy.add(raw)
            return True
        return raw == "bitwise"

    # ----- backend choice (the one place) --------------------------------------------------------------------
    def _kernel_for(self, x: torch.Tensor) -> KernelVerdict | None:
        """The verified ``npu_rotary_mul`` verdict for ``x``'s (device, dtype, head_dim), or None (portable)."""
        if not self.use_npu_kernel:
            return None
        mod = _backend.torch_npu_module()
        if mod is None:
            return None
        if mod is not self._verdict_mod:
            self._verdicts.clear()
            self._shapes.clear()
            self._verdict_mod = mod
        key = (str(x.device), x.dtype, x.shape[-1])
        v = self._verdicts.get(key)
        if v is None:
            kernel = getattr(mod, "npu_rotary_mul", None)
            if kernel is None:
                v = KernelVerdict(key[0], x.dtype, x.shape[-1], ok=False, reason="torch_npu has no npu_rotary_mul")
            else:
                v = verify_kernel(kernel, x.device, x.dtype, x.shape[-1], x.shape[2])
                if v.ok and self.requires_bitwise() and not v.bitwise_vs_stock:
                    v.ok, v.fn = False, None
                    v.reason = (
                        f"within tolerance but not bitwise-equal to stock math, and {ENV_KERNEL_POLICY}=bitwise "
                        "keeps rope in the exact tier: the portable path is used (the default policy 'pixel' "
                        "accepts it)"
                    )
            self._verdicts[key] = v
            (logger.info if v.ok else logger.warning)("vllm-omni-ascend-opt: rope: %s", v.describe())
        return v if v.ok else None

    def _apply(self, x: torch.Tensor, tables: _Tables, freqs: torch.Tensor, rope: nn.Module) -> torch.Tensor:
        verdict = self._kernel_for(x)
        if verdict is not None:
            b, _, n, d = x.shape
            key = shape_class(x)
            checked = self._shapes.get(key)
            eligible = freqs.shape[-1] * 2 == d and b * n < _KERNEL_BN_LIMIT and x.dtype in _KERNEL_DTYPES
            if eligible and (checked is None or checked.ok):
                cos, sin = _npu_tables(tables, freqs, self.stats)
                try:
                    out = verdict.fn(x, cos, sin, rotary_mode="interleave")  # type: ignore[misc]
                except Exception as exc:
                    checked = ShapeVerdict(key, ok=False, reason=f"the kernel raised {exc.__class__.__name__}: {exc}")
                    self._shapes[key] = checked
                    logger.warning("vllm-omni-ascend-opt: rope: %s", checked.describe())
                else:
                    if checked is None:
                        pc, ps = _portable_tables(tables, freqs, self.stats)
                        checked = verify_at_shape(x, out, pc, ps, bitwise=self.requires_bitwise())
                        self._shapes[key] = checked
                        self.stats["shape_checks"] += 1
                        (logger.info if checked.ok else logger.warning)(
                            "vllm-omni-ascend-opt: rope: %s", checked.describe()
                        )
                    if checked.ok:
                        self.stats["kernel_calls"] += 1
                        return out
        if _native_equivalent(rope):
            cos, sin_signed = _portable_tables(tables, freqs, self.stats)
            self.stats["portable_calls"] += 1
            return apply_portable(x, cos, sin_signed)
        cos, sin = _half_tables(tables, freqs, self.stats)
        self.stats["delegate_calls"] += 1
        return rope(x, cos, sin)

    # ----- patches -------------------------------------------------------------------------------------------
    def _make_qk_norm_rope(self, original: Callable[..., Any]) -> Callable[..., Any]:
        opt = self
        mod = sys.modules[_targets.TRANSFORMER]

        def _qwen_image_qk_norm_rope(
            q: torch.Tensor,
            k: torch.Tensor,
            norm_q: nn.Module,
            norm_k: nn.Module,
            freqs: torch.Tensor,
            rope: nn.Module,
            eps: float,
            *,
            use_fused: bool = True,
        ) -> tuple[torch.Tensor, torch.Tensor]:
            """vLLM-Omni's ``_qwen_image_qk_norm_rope`` with cached cos/sin (and the verified NPU kernel)."""
            if (
                torch.is_grad_enabled()
                or torch.compiler.is_compiling()
                or q.dim() != 4
                or freqs.dim() != 2
                or not freqs.is_complex()
                or freqs.shape[0] != q.shape[1]
                or freqs.shape[-1] * 2 > q.shape[-1]
                or _backend.graph_capture_reason() is not None
            ):
                opt.stats["stock_calls"] += 1
                return original(q, k, norm_q, norm_k, freqs, rope, eps, use_fused=use_fused)
            # Stock's fused CUDA (Triton) branch, same condition in the same order.
            head_dim, rotary_dim = q.shape[-1], freqs.shape[-1] * 2
            tokens = q.shape[0] * q.shape[1]
            if (
                use_fused
                and tokens >= mod.fused_qk_norm_rope_min_tokens(mod._FUSED_MIN_TOKENS)
                and mod._fused_cuda_supported(q, k, head_dim, rotary_dim, interleaved=True)
            ):
                opt.stats["stock_calls"] += 1
                return original(q, k, norm_q, norm_k, freqs, rope, eps, use_fused=use_fused)
            tables = opt._tables.get(freqs, q.dtype)  # stock converts to q.dtype (before the norm)
            q = norm_q(q)
            k = norm_k(k)
            return opt._apply(q, tables, freqs, rope), opt._apply(k, tables, freqs, rope)

        _qwen_image_qk_norm_rope.__wrapped__ = original  # type: ignore[attr-defined]
        return _qwen_image_qk_norm_rope

    def _make_embed_forward(self, original: Callable[..., Any]) -> Callable[..., Any]:
        opt = self

        def forward(module: nn.Module, video_fhw: Any, txt_seq_lens: Any, device: Any) -> Any:
            """``QwenEmbedRope.forward`` memoized: same arguments and tables -> the same (vid, txt) freqs objects."""
            if torch.is_grad_enabled() or torch.compiler.is_compiling():
                return original(module, video_fhw, txt_seq_lens, device)
            key = _embed_key(module, video_fhw, txt_seq_lens, device)
            memo = opt._embed_memo.get(module)
            if key is not None and memo is not None:
                hit = memo.get(key[0])
                if hit is not None and all(r() is t for r, t in zip(hit[0], key[1], strict=True)):
                    memo.move_to_end(key[0])
                    opt.stats["embed_memo_hits"] += 1
                    return hit[1]
            out = original(module, video_fhw, txt_seq_lens, device)
            after = _embed_key(module, video_fhw, txt_seq_lens, device)  # forward may have moved the tables
            if after is not None:
                memo = opt._embed_memo.setdefault(module, OrderedDict())
                memo[after[0]] = (tuple(weakref.ref(t) for t in after[1]), out)
                while len(memo) > _EMBED_MEMO_SIZE:
                    memo.popitem(last=False)
            return out

        forward.__wrapped__ = original  # type: ignore[attr-defined]
        return forward


def _plain(obj: Any) -> Any:
    """Nested lists/tuples of ints as nested tuples of ints; None when anything else is inside."""
    if isinstance(obj, bool):
        return None
    if isinstance(obj, int):
        return int(obj)
    if isinstance(obj, (list, tuple)):
        items = tuple(_plain(o) for o in obj)
        return None if any(i is None for i in items) else (type(obj).__name__, items)
    return None


def _embed_key(module: nn.Module, video_fhw: Any, txt_seq_lens: Any, device: Any) -> tuple[tuple, tuple] | None:
    """(hashable key, tensors whose identity it names) for one ``QwenEmbedRope.forward`` call, or None."""
    fhw, lens = _plain(video_fhw), _plain(txt_seq_lens)
    pos, neg = getattr(module, "pos_freqs", None), getattr(module, "neg_freqs", None)
    if fhw is None or lens is None or not isinstance(pos, torch.Tensor) or not isinstance(neg, torch.Tensor):
        return None
    try:
        dev = str(torch.device(device))
    except (TypeError, RuntimeError):
        return None
    key = (
        fhw,
        lens,
        dev,
        id(pos),
        id(neg),
        _version_or_none(pos),
        _version_or_none(neg),
        bool(getattr(module, "scale_rope", False)),
        tuple(getattr(module, "axes_dim", ())),
        getattr(module, "theta", None),
    )
    return key, (pos, neg)


OPT = Rope()
