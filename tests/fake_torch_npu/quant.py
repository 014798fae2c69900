"""Fake torch_npu kernels: dynamic int8 quantization and the int8 GEMM (``npu_dynamic_quant``, ``npu_quant_matmul``).

Sources (see ``__init__``; the constraints are checked below, each citing its source):

* [OP-DQ] Ascend/op-plugin ``docs/context/torch_npu-npu_dynamic_quant.md``: symmetric per-token int8 quantization of
  the last dim, ``scale = max(|x|) / 127`` per row (float32), ``y = round(x / scale)``; ``x`` float16 or bfloat16.
* [OP-QMM] ``torch_npu-npu_quant_matmul.md``: int8 ``x1 [m, k]`` and ``x2 [k, n]`` (ND or FRACTAL_NZ), int32
  accumulation, output ``(acc * scale[n] * pertoken_scale[m]) + bias`` in ``output_dtype``; an int32 bias is added to
  the accumulator, a float one after dequantization.
* [OMNI-65535] vLLM-Omni 0.30 ``int8_config.NPU_QUANT_MATMUL_MAX_OUT_FEATURES``: QuantBatchMatmulV3 refuses n > 65535.
* [TNPU-YAML] the wheel's ``npu_native_functions_by_codegen.yaml`` (both signatures); ``output_dtype`` is the meta
  function's dtype enum (``15`` bfloat16, ``5`` float16) or, as vLLM-Omni passes it, a ``torch.dtype``.

int32 sums of int8 products are exact in float64, so the fake accumulates there: the same integers in any order,
which is why an NZ weight gives bit-identical results ([OP-QMM]).
"""

from __future__ import annotations

from typing import Any

import torch

from tests.fake_torch_npu import formats
from tests.fake_torch_npu.formats import FakeNpuError

MAX_N = 65535  # [OMNI-65535]
_DTYPE_ENUM = {5: torch.float16, 15: torch.bfloat16, 6: torch.float32, 1: torch.int8, 3: torch.int32}


def npu_dynamic_quant(
    input: torch.Tensor,
    *,
    smooth_scales: torch.Tensor | None = None,
    group_index: torch.Tensor | None = None,
    dst_type: int | None = None,
    quant_mode: str = "pertoken",
    dst_type_max: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """[OP-DQ] (int8 values, float32 per-token scale)."""
    if smooth_scales is not None or group_index is not None or dst_type not in (None, 1) or dst_type_max:
        raise NotImplementedError("fake npu_dynamic_quant: only plain symmetric int8 is modelled")
    if quant_mode != "pertoken":
        raise NotImplementedError(f"fake npu_dynamic_quant: quant_mode {quant_mode!r} is not modelled")
    if input.dtype not in (torch.float16, torch.bfloat16):
        raise FakeNpuError(f"npu_dynamic_quant: x must be float16 or bfloat16, got {input.dtype} [OP-DQ]")
    if input.dim() < 2:
        raise FakeNpuError(f"npu_dynamic_quant: x must have at least 2 dims, got {input.dim()} [OP-DQ]")
    x = input.float()
    scale = x.abs().amax(dim=-1) / 127.0
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    y = torch.round(x / safe.unsqueeze(-1)).clamp_(-128, 127).to(torch.int8)
    return y, scale


def _out_dtype(output_dtype: Any) -> torch.dtype:
    if output_dtype is None:
        raise NotImplementedError("fake npu_quant_matmul: int8 output (output_dtype=None) is not modelled")
    dt = output_dtype if isinstance(output_dtype, torch.dtype) else _DTYPE_ENUM.get(int(output_dtype))
    if dt not in (torch.float16, torch.bfloat16):
        raise NotImplementedError(f"fake npu_quant_matmul: output_dtype {output_dtype!r} is not modelled")
    return dt


def _check(x1, x2, scale, pertoken_scale, bias, out: torch.dtype) -> tuple[int, int, int]:
    if x1.dtype != torch.int8 or x2.dtype != torch.int8:
        raise FakeNpuError(f"npu_quant_matmul: x1 and x2 must be int8, got {x1.dtype} and {x2.dtype} [OP-QMM]")
    if not 2 <= x1.dim() <= 6 or x2.dim() != 2:
        raise FakeNpuError(f"npu_quant_matmul: x1 2-6 dims and a 2-D x2, got {x1.dim()} and {x2.dim()} [OP-QMM]")
    m, k = x1.shape[-2:]
    k2, n = x2.shape
    if k != k2:
        raise FakeNpuError(f"npu_quant_matmul: k dim of x1 ({k}) and x2 ({k2}) need be same [OP-QMM]")
    if n > MAX_N:
        raise FakeNpuError(f"npu_quant_matmul: n = {n} > {MAX_N} is not supported [OMNI-65535]")
    if scale.dtype not in (torch.float32, torch.bfloat16) or scale.dim() != 1 or scale.shape[0] not in (1, n):
        raise FakeNpuError(f"npu_quant_matmul: scale fp32/bf16 of shape (1,) or ({n},), got {scale.dtype} "
                           f"{tuple(scale.shape)} [OP-QMM]")  # fmt: skip
    if scale.dtype == torch.bfloat16 and out != torch.bfloat16:
        raise FakeNpuError("npu_quant_matmul: a bfloat16 scale needs a bfloat16 output [OP-QMM]")
    rows = x1.numel() // k
    if pertoken_scale is not None and (
        pertoken_scale.dtype != torch.float32 or pertoken_scale.dim() != 1 or pertoken_scale.shape[0] != rows
    ):
        raise FakeNpuError(f"npu_quant_matmul: pertoken_scale fp32 of shape ({rows},), got {pertoken_scale.dtype} "
                           f"{tuple(pertoken_scale.shape)} [OP-QMM]")  # fmt: skip
    if bias is not None and (
        bias.dim() != 1 or bias.shape[0] != n or bias.dtype not in (torch.int32, torch.float32, out)
    ):
        raise FakeNpuError(f"npu_quant_matmul: bias int32/fp32/{out} of shape ({n},), got {bias.dtype} "
                           f"{tuple(bias.shape)} [OP-QMM]")  # fmt: skip
    return m, k, n


def _weight(x2: torch.Tensor) -> torch.Tensor:
    """The logical ``[k, n]`` weight: the fake keeps values logically, whatever the format tag [OP-QMM]."""
    if not formats.on_npu(x2):
        raise FakeNpuError("npu_quant_matmul: x2 must be an NPU tensor [OP-QMM]")
    fmt = formats.get_npu_format(x2)
    if fmt not in (formats.ND, formats.FRACTAL_NZ):
        raise FakeNpuError(f"npu_quant_matmul: x2 must be ND or FRACTAL_NZ, got format {fmt} [OP-QMM]")
    return x2


def _make_quant_matmul(read_weight: Any) -> Any:
    """[OP-QMM] ``(x1 @ x2 in int32) * scale * pertoken_scale + bias``; ``read_weight``: what is read of ``x2``."""

    def npu_quant_matmul(
        x1: torch.Tensor,
        x2: torch.Tensor,
        scale: torch.Tensor,
        *,
        offset: torch.Tensor | None = None,
        pertoken_scale: torch.Tensor | None = None,
        bias: torch.Tensor | None = None,
        output_dtype: int | None = None,
        x1_dtype: int | None = None,
        x2_dtype: int | None = None,
        pertoken_scale_dtype: int | None = None,
        scale_dtype: int | None = None,
        group_sizes: list[int] | None = None,
        y_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        extras = (offset, x1_dtype, x2_dtype, pertoken_scale_dtype, scale_dtype, group_sizes, y_scale)
        if any(e is not None for e in extras):
            raise NotImplementedError(
                "fake npu_quant_matmul: offset / x*_dtype / group_sizes / y_scale are not modelled"
            )
        out = _out_dtype(output_dtype)
        _check(x1, x2, scale, pertoken_scale, bias, out)
        w = read_weight(_weight(x2))
        acc = torch.matmul(x1.double(), w.double())  # exact int32 sums
        if bias is not None and bias.dtype == torch.int32:
            acc = acc + bias.double()
        y = acc.float() * scale.float()
        if pertoken_scale is not None:
            y = y * pertoken_scale.reshape(*x1.shape[:-1], 1)
        if bias is not None and bias.dtype != torch.int32:
            y = y + bias.float()
        return y.to(out)

    return npu_quant_matmul


def _misread(w: torch.Tensor) -> torch.Tensor:
    """Variant ``nz_misread``: an NZ ``x2`` read as ND (its fractal storage row-major), as without WeightNz."""
    return formats.misread_nz(w.t()).t() if formats.get_npu_format(w) == formats.FRACTAL_NZ else w


VARIANTS: dict[str, dict[str, Any]] = {
    "npu_dynamic_quant": {"correct": npu_dynamic_quant},
    "npu_quant_matmul": {"correct": _make_quant_matmul(lambda w: w), "nz_misread": _make_quant_matmul(_misread)},
}
