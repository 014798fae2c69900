"""Fake torch_npu kernels: rotary (``npu_rotary_mul``). Each documented constraint is checked with its source cited.

Sources (see ``__init__``):

* [OP-ROT] Ascend/op-plugin ``docs/zh/custom_APIs/torch_npu/torch_npu-npu_rotary_mul.md`` (snapshot 517f2e7; same
  text as the 7.3.0 page): out = x * r1 + rotate(x) * r2 with half: rotate(x) = cat(-x2, x1) over chunk(x, 2, -1);
  interleave: rotate(x) = stack((-x[..., 1::2], x[..., ::2]), -1) flattened; the shape limits and r1/r2 layout
  classes of :func:`check_args`.
* [OP-ROT-IMPL] op-plugin ``RotaryMulKernelNpuOpApi.cpp``: ``TORCH_CHECK`` on rotary_mode; r1/r2 cast to input's
  dtype. Its aclops fallback (``RotaryMulKernelNpu.cpp``) before op-plugin 7.0.0 **ignores rotary_mode** (the
  ``half_pairing`` variant); in the 7.x line (commit 0581e5a) it *raises* for interleave [OP-ROT-ACLOP] (``aclop``).
* [TNPU-YAML] the torch-npu 2.13.0 wheel: ``npu_rotary_mul(Tensor self, Tensor r1, Tensor r2, str rotary_mode='half',
  Tensor? rotate=None) -> Tensor``. [OP-ROT-6.0] torch_npu 6.0 (hiascend.com ``ptaoplist_000486``): no
  ``rotary_mode`` argument (half only): the ``no_rotary_mode`` variant.

The computation is one ``torch.library`` custom op: one launch for an op counter.
"""

from __future__ import annotations

from typing import Any

import torch

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # [OP-ROT] parameters
_MODES = ("half", "interleave")  # [OP-ROT-IMPL] TORCH_CHECK on rotary_mode
_D_LIMIT = 896  # [OP-ROT] D < 896 and even (both modes)
_BN_LIMIT = 1000  # [OP-ROT] half: B < 1000 and N < 1000; interleave: B * N < 1000


class FakeNpuError(RuntimeError):
    """Raised where the real kernel rejects its arguments (a TORCH_CHECK / aclnn parameter error)."""


# ----- the computation: one custom op, so it counts as one launch -----------------------------------------------------
@torch.library.custom_op("fake_torch_npu::rotary_mul", mutates_args=())
def _rotary_mul_op(x: torch.Tensor, r1: torch.Tensor, r2: torch.Tensor, pairing: str, precision: str) -> torch.Tensor:
    """out = x * r1 + rotate(x) * r2. ``precision``: "fp32" (one rounding at the end, as a fused vector kernel does) or
    "native" (the documented small-op formula evaluated in the input dtype, one rounding per op)."""
    # [OP-ROT] r1/r2 data range [-1, 1]; checked here so its reductions are not counted as launches.
    for name, r in (("r1", r1), ("r2", r2)):
        if r.numel() and not bool((r.float().abs() <= 1.0).all()):
            raise FakeNpuError(f"npu_rotary_mul: {name} values must lie in [-1, 1] [OP-ROT]")
    dtype = x.dtype
    if precision == "fp32":
        x, r1, r2 = x.float(), r1.float(), r2.float()
    if pairing == "interleave":
        x1, x2 = x[..., ::2], x[..., 1::2]
        rot = torch.stack((-x2, x1), dim=-1).flatten(-2)
    else:
        x1, x2 = x.chunk(2, dim=-1)
        rot = torch.cat((-x2, x1), dim=-1)
    out = x * r1 + rot * r2
    return out.to(dtype)


@_rotary_mul_op.register_fake
def _(x, r1, r2, pairing, precision):
    return torch.empty_like(x)


# ----- documented argument checks -------------------------------------------------------------------------------------
def _shape_class(x: torch.Tensor, r: torch.Tensor, mode: str) -> tuple[str, int, int]:
    """Return (layout, B, N) for ``x`` given the broadcast shape of ``r``, or raise [OP-ROT layout tables]."""
    xs, rs = tuple(x.shape), tuple(r.shape)
    d = xs[-1]
    if rs[-1] != d:
        raise FakeNpuError(f"npu_rotary_mul: r1/r2 last dim {rs[-1]} != input D {d} [OP-ROT]")
    if x.dim() == 3:  # TND
        t, n, _ = xs
        allowed = {"T1D": (t, 1, d)} if mode == "interleave" else {"T1D": (t, 1, d), "TND": (t, n, d)}
        if rs in allowed.values():
            return "TND", 1, n
        raise FakeNpuError(
            f"npu_rotary_mul({mode}): r1/r2 shape {rs} not in {sorted(allowed)} for TND input {xs} [OP-ROT]"
        )
    a, b, c, _ = xs
    # (layout, {class name: r shape}, B, N) for the three 4D layouts [OP-ROT]; interleave takes the first class only.
    table = [
        ("BNSD", {"11SD": (1, 1, c, d), "B1SD": (a, 1, c, d), "BNSD": (a, b, c, d)}, a, b),
        ("BSND", {"1S1D": (1, b, 1, d), "BS1D": (a, b, 1, d), "BSND": (a, b, c, d)}, a, c),
        ("SBND", {"S11D": (a, 1, 1, d), "SB1D": (a, b, 1, d), "SBND": (a, b, c, d)}, b, c),
    ]
    if mode == "interleave":
        table = [(layout, dict([next(iter(classes.items()))]), bb, nn) for layout, classes, bb, nn in table]
    for layout, classes, bb, nn in table:
        if rs in classes.values():
            return layout, bb, nn
    names = sorted({k for _, classes, _, _ in table for k in classes})
    raise FakeNpuError(f"npu_rotary_mul({mode}): r1/r2 shape {rs} is not one of {names} for input {xs} [OP-ROT]")


def check_args(x: torch.Tensor, r1: torch.Tensor, r2: torch.Tensor, rotary_mode: str) -> tuple[str, int, int]:
    """Raise :class:`FakeNpuError` on every documented violation; return (layout, B, N)."""
    if rotary_mode not in _MODES:
        raise FakeNpuError(
            f"The rotary_mode of npu_rotary_mul should be half or interleave, but got {rotary_mode} [OP-ROT-IMPL]"
        )
    for name, t in (("input", x), ("r1", r1), ("r2", r2)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"npu_rotary_mul: {name} must be a Tensor")
        if t.dim() not in (3, 4):
            raise FakeNpuError(f"npu_rotary_mul: {name} must be 3D or 4D, got {t.dim()}D [OP-ROT]")
        if t.dtype not in _DTYPES:
            raise FakeNpuError(f"npu_rotary_mul: {name} dtype {t.dtype} not in float16/bfloat16/float32 [OP-ROT]")
    if r1.dim() != x.dim() or r2.dim() != x.dim():
        raise FakeNpuError("npu_rotary_mul: r1/r2 must have input's rank [OP-ROT layout tables]")
    if r1.shape != r2.shape:
        raise FakeNpuError(f"npu_rotary_mul: r1 {tuple(r1.shape)} and r2 {tuple(r2.shape)} differ [OP-ROT]")
    d = x.shape[-1]
    if d % 2 or d >= _D_LIMIT:
        raise FakeNpuError(f"npu_rotary_mul: D={d} must be even and < {_D_LIMIT} [OP-ROT]")
    layout, b, n = _shape_class(x, r1, rotary_mode)
    if rotary_mode == "interleave" and b * n >= _BN_LIMIT:
        raise FakeNpuError(f"npu_rotary_mul(interleave): B*N={b * n} must be < {_BN_LIMIT} ({layout}) [OP-ROT]")
    if rotary_mode == "half" and (b >= _BN_LIMIT or n >= _BN_LIMIT):
        raise FakeNpuError(f"npu_rotary_mul(half): B={b}, N={n} must each be < {_BN_LIMIT} ({layout}) [OP-ROT]")
    return layout, b, n


def _cast_like(x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    # [OP-ROT-IMPL] isRotaryMulMixDtypeSupport: r1/r2 are cast to input's dtype.
    return r if r.dtype == x.dtype else r.to(x.dtype)


# ----- variants -------------------------------------------------------------------------------------------------------
def npu_rotary_mul(self, r1, r2, rotary_mode="half", rotate=None):
    """Documented behaviour [OP-ROT] as a fused kernel computes it (fp32 inside, one rounding); schema [TNPU-YAML]."""
    if rotate is not None:
        raise NotImplementedError("fake npu_rotary_mul: the `rotate` matrix argument is not modelled")
    check_args(self, r1, r2, rotary_mode)
    return _rotary_mul_op(self, _cast_like(self, r1), _cast_like(self, r2), rotary_mode, "fp32")


def npu_rotary_mul_small_ops(self, r1, r2, rotary_mode="half", rotate=None):
    """Documented formula evaluated op by op in the input dtype (bitwise-equal to vLLM-Omni's eager RoPE)."""
    check_args(self, r1, r2, rotary_mode)
    return _rotary_mul_op(self, _cast_like(self, r1), _cast_like(self, r2), rotary_mode, "native")


def npu_rotary_mul_half_pairing(self, r1, r2, rotary_mode="half", rotate=None):
    """WRONG on purpose: always pairs halves, as the aclops fallback does [OP-ROT-IMPL: RotaryMulKernelNpu.cpp]."""
    check_args(self, r1, r2, rotary_mode)
    return _rotary_mul_op(self, _cast_like(self, r1), _cast_like(self, r2), "half", "fp32")


def npu_rotary_mul_low_precision(self, r1, r2, rotary_mode="half", rotate=None):
    """WRONG on purpose: right pairing, computed in float16 whatever the input dtype (caught by an fp32 check)."""
    check_args(self, r1, r2, rotary_mode)
    out = _rotary_mul_op(self.half(), r1.half(), r2.half(), rotary_mode, "native")
    return out.to(self.dtype)


def npu_rotary_mul_no_rotary_mode(self, r1, r2):
    """Old signature without ``rotary_mode`` [OP-ROT-6.0]: passing it raises TypeError."""
    check_args(self, r1, r2, "half")
    return _rotary_mul_op(self, _cast_like(self, r1), _cast_like(self, r2), "half", "fp32")


#: Deliberately not the 2.13.0 schema (an older release's); the signature check against the wheel skips it.
npu_rotary_mul_no_rotary_mode.legacy_signature = "[OP-ROT-6.0]"  # type: ignore[attr-defined]


def npu_rotary_mul_aclop(self, r1, r2, rotary_mode="half", rotate=None):
    """The old aclop path: since op-plugin 7.0.0 it rejects every mode but ``half`` [OP-ROT-ACLOP]."""
    if rotary_mode != "half":
        raise FakeNpuError(
            f"npu_rotary_mul in aclop only support rotary_mode with half, but got {rotary_mode} [OP-ROT-ACLOP]"
        )
    return npu_rotary_mul(self, r1, r2, rotary_mode, rotate)


def npu_rotary_mul_long_seq_bug(self, r1, r2, rotary_mode="half", rotate=None):
    """WRONG on purpose beyond S = 64 (half pairing there): a long-sequence tiling bug a toy-shape check cannot see."""
    if self.dim() == 4 and self.shape[1] > 64:
        return npu_rotary_mul_half_pairing(self, r1, r2, rotary_mode, rotate)
    return npu_rotary_mul(self, r1, r2, rotary_mode, rotate)


def npu_rotary_mul_raises(self, r1, r2, rotary_mode="half", rotate=None) -> torch.Tensor:
    """A kernel that fails on every call (broken CANN install, missing aclnn binary)."""
    raise RuntimeError("fake npu_rotary_mul: aclnnRotaryPositionEmbedding failed (EZ9999)")


#: kernel name -> {variant: implementation}; "correct" follows the documentation.
VARIANTS: dict[str, dict[str, Any]] = {
    "npu_rotary_mul": {
        "correct": npu_rotary_mul,
        "small_ops": npu_rotary_mul_small_ops,
        "half_pairing": npu_rotary_mul_half_pairing,
        "low_precision": npu_rotary_mul_low_precision,
        "no_rotary_mode": npu_rotary_mul_no_rotary_mode,
        "aclop": npu_rotary_mul_aclop,
        "long_seq_bug": npu_rotary_mul_long_seq_bug,
        "raises": npu_rotary_mul_raises,
    }
}
