"""Fake torch_npu kernels: tensor formats (``npu_format_cast``, ``get_npu_format``) and the device model.

Sources (see ``__init__``):

* [OP-FMT] Ascend/op-plugin ``docs/context/（beta）torch_npu-npu_format_cast.md`` (commit 18c2792): returns a *new*
  tensor; ``acl_format`` an int or ``torch_npu.Format`` (``FORMATS``; FRACTAL_NZ=29 is internal). [OP-GFMT]
  ``at_npu-native-get_npu_format.md``: the format, an int. [TNPU-FMT-SAME] a cast to the tensor's own format returns it.
* [OP-AIF] ``torch_npu-npu-config-allow_internal_format.md``: ``False`` (default on A3, ``True`` on A2) forbids any
  private-format tensor; the real reaction to a forbidden cast is undocumented: the fake raises.
* [TNPU-CFG] torch-npu 2.13.0 ``npu/npu_config.py``: ``torch.npu.config`` is **write-only** (``_C._npu_setOption``).
  [TNPU-YAML] its ``npu_native_functions_by_codegen.yaml``: the signatures below. [TNPU-ISNPU] ``Tensor.is_npu``.
* [VA-10287] vllm-ascend PRs #10287, #16058: ``aclnnMatmulWeightNz`` rejects a FRACTAL_NZ mat2 with n == 1 or k == 1
  (the *matmul* fails). [VA-3356] PR #3356: before CANN 8.3 a linear with an NZ weight misses the WeightNz kernels.

Device model: while the fake is installed, CPU tensors stand for NPU memory unless their storage was marked as host
memory (:func:`mark_host`). The format tag lives on the *storage*, as torch_npu's ``NPUStorageDesc``: it follows
``param.data = ...`` and views, and dies with the storage.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ND = 2
NCHW = 0
FRACTAL_NZ = 29
#: [OP-FMT] Format table: value -> name.
FORMATS = {
    -1: "UNDEFINED",
    0: "NCHW",
    1: "NHWC",
    2: "ND",
    3: "NC1HWC0",
    4: "FRACTAL_Z",
    12: "NC1HWC0_C04",
    16: "HWCN",
    27: "NDHWC",
    29: "FRACTAL_NZ",
    30: "NCDHW",
    32: "NDC1HWC0",
    33: "FRACTAL_Z_3D",
    35: "NC",
    47: "NCL",
}
#: Private (internal) formats: the 5-D/fractal layouts that only exist on the device [OP-FMT], gated by [OP-AIF].
INTERNAL_FORMATS = frozenset({3, 4, 12, 29, 32, 33})

_TAG = "_fake_npu_format"
_HOST = "_fake_npu_host"


class FakeNpuError(RuntimeError):
    """Raised where the real torch_npu rejects its arguments (a TORCH_CHECK / aclnn parameter error)."""


# ----- device model ---------------------------------------------------------------------------------------------------
def on_npu(t: torch.Tensor) -> bool:
    """Whether ``t`` stands for NPU memory in the fake: a CPU tensor whose storage is not marked as host memory."""
    if t.device.type != "cpu":
        return False
    return not getattr(t.untyped_storage(), _HOST, False)


def mark_host(t: torch.Tensor) -> torch.Tensor:
    """Mark ``t``'s storage as host memory (CPU / layerwise offload): ``is_npu`` becomes False. Returns ``t``."""
    setattr(t.untyped_storage(), _HOST, True)
    return t


def install_hooks(monkeypatch: Any, mod: Any) -> None:
    """Give CPU tensors torch_npu's ``Tensor.is_npu`` property for the duration of a test [TNPU-ISNPU]."""
    monkeypatch.setattr(torch.Tensor, "is_npu", property(on_npu), raising=False)
    mod.mark_host = mark_host
    mod.Format = type("Format", (), {name: value for value, name in FORMATS.items()})


# ----- the copy: one custom op, so an op counter sees one launch (the device's TransData), not the fake's own ops -----
@torch.library.custom_op("fake_torch_npu::format_cast", mutates_args=())
def _format_cast_op(x: torch.Tensor) -> torch.Tensor:
    return x.clone(memory_format=torch.contiguous_format)


@_format_cast_op.register_fake
def _(x):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _format_value(acl_format: Any) -> int:
    value = int(getattr(acl_format, "value", acl_format))
    if value not in FORMATS:
        raise FakeNpuError(f"npu_format_cast: unknown acl_format {acl_format!r} (known: {sorted(FORMATS)}) [OP-FMT]")
    return value


def _allow_internal_format() -> bool:
    """The installed fake's ``ALLOW_INTERNAL_FORMAT`` option (``torch.npu.config`` is write-only [TNPU-CFG])."""
    import sys

    c = getattr(sys.modules.get("torch_npu"), "_C", None)
    value = c._npu_getOption("ALLOW_INTERNAL_FORMAT") if c is not None else None
    return value == b"enable"


def get_npu_format(self: torch.Tensor) -> int:
    """[OP-GFMT] The tensor's NPU format: the cast's tag, else the base format (NCHW for 4-D, ND otherwise) [OP-FMT]."""
    if not isinstance(self, torch.Tensor):
        raise TypeError("get_npu_format expects a Tensor")
    if not on_npu(self):
        raise FakeNpuError("get_npu_format: expected an NPU tensor [OP-GFMT]")
    tag = getattr(self.untyped_storage(), _TAG, None)
    if tag is not None:
        return tag
    return NCHW if self.dim() == 4 else ND


def _check_cast_args(self: Any, acl_format: Any, customize_dtype: Any, input_dtype: Any) -> int:
    if not isinstance(self, torch.Tensor):
        raise TypeError("npu_format_cast expects a Tensor")
    if customize_dtype is not None or input_dtype is not None:
        raise NotImplementedError("fake npu_format_cast: customize_dtype / input_dtype are not modelled")
    return _format_value(acl_format)


def npu_format_cast(
    self: torch.Tensor, acl_format: Any, *, customize_dtype: int | None = None, input_dtype: int | None = None
) -> torch.Tensor:
    """[OP-FMT] ``self``'s values in format ``acl_format``: a *new* tensor (``self`` is unchanged), or ``self`` itself
    when it already is in that format [TNPU-FMT-SAME]. Signature as the real schema [TNPU-YAML]."""
    fmt = _check_cast_args(self, acl_format, customize_dtype, input_dtype)
    if not on_npu(self):
        raise FakeNpuError(f"npu_format_cast: expected an NPU tensor, got one on {self.device} / host memory [OP-FMT]")
    if get_npu_format(self) == fmt:
        return self
    if fmt in INTERNAL_FORMATS and not _allow_internal_format():
        raise FakeNpuError(
            f"npu_format_cast to {FORMATS[fmt]}: the ALLOW_INTERNAL_FORMAT option is disabled "
            "(torch.npu.config.allow_internal_format = False), no private-format tensor may be allocated [OP-AIF]"
        )
    out = _format_cast_op(self)
    setattr(out.untyped_storage(), _TAG, fmt)
    return out


def _nz_cast_keeps_nd(
    self: torch.Tensor, acl_format: Any, *, customize_dtype: int | None = None, input_dtype: int | None = None
) -> torch.Tensor:
    """Variant ``keeps_nd``: returns a copy but never changes the format (an op that silently ignores the request)."""
    _check_cast_args(self, acl_format, customize_dtype, input_dtype)
    return _format_cast_op(self)


# ----- where the real device fails on NZ weights ----------------------------------------------------------------------
_MATMULS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::linear", "aten::matmul"}


class _NzMatmulCheck(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._schema.name in _MATMULS:
            for a in (*args, *(kwargs or {}).values()):
                if (
                    isinstance(a, torch.Tensor)
                    and a.dim() >= 2
                    and on_npu(a)
                    and getattr(a.untyped_storage(), _TAG, None) == FRACTAL_NZ
                    and 1 in a.shape[-2:]
                ):
                    raise FakeNpuError(
                        f"{func._schema.name}: Not support mat2 n = 1 or k = 1 when format is FRACTAL_NZ "
                        f"(shape {tuple(a.shape)}) [VA-10287]"
                    )
        return func(*args, **(kwargs or {}))


def nz_matmul_check() -> TorchDispatchMode:
    """Within the block, a matmul that reads a FRACTAL_NZ operand with n == 1 or k == 1 raises, as on the device."""
    return _NzMatmulCheck()


def misread_nz(t: torch.Tensor) -> torch.Tensor:
    """A 2-D FRACTAL_NZ tensor as a format-blind kernel sees it: its (k/16, n/16, 16, 16) fractals read row-major."""
    n, k = t.shape
    n1, k1 = -(-n // 16), -(-k // 16)
    padded = t.new_zeros(n1 * 16, k1 * 16)
    padded[:n, :k] = t
    fractal = padded.reshape(n1, 16, k1, 16).permute(2, 0, 1, 3).reshape(-1)
    return fractal[: n * k].reshape(n, k)


class _NzRoute(TorchDispatchMode):
    def __init__(self, broken: frozenset[str]) -> None:
        super().__init__()
        self.broken = broken

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._schema.name in self.broken:
            fixed = []
            for a in args:
                if isinstance(a, torch.Tensor) and a.dim() == 2 and getattr(a.untyped_storage(), _TAG, None) == 29:
                    a = misread_nz(a.t()).t() if a.stride(0) == 1 and a.stride(1) != 1 else misread_nz(a)
                fixed.append(a)
            args = tuple(fixed)
        return func(*args, **(kwargs or {}))


def nz_route_ignores_format(*ops: str) -> TorchDispatchMode:
    """Within the block, the named aten ops (``"aten::addmm"``, ``"aten::mm"``) read an NZ operand as ND: an old
    op-plugin / CANN whose ``F.linear`` with an NZ weight misses the WeightNz kernels [VA-3356]."""
    return _NzRoute(frozenset(ops))


#: kernel name -> {variant: implementation}; "correct" follows the documentation.
VARIANTS: dict[str, dict[str, Any]] = {
    "npu_format_cast": {"correct": npu_format_cast, "keeps_nd": _nz_cast_keeps_nd},
    "get_npu_format": {"correct": get_npu_format},
}
