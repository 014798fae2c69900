"""Fake torch_npu kernels: normalization (``npu_layer_norm_eval``, ``npu_rms_norm``).

Sources (see ``__init__``):

* [OP-LNE] the torch-npu 2.13.0 wheel's ``_op_plugin_docs.py``: ``npu_layer_norm_eval`` is ``F.layer_norm``'s result
  (first argument named ``input``, unlike most ops); meta: ``empty_like(input)``.
* [OP-RMS] op-plugin ``torch_npu-npu_rms_norm.md`` and ``_op_plugin_docs.py``: ``y = x * rstd * gamma`` (self's
  dtype) and ``rstd = 1 / sqrt(mean(x^2 over gamma's dims) + eps)`` (float32, shaped by the wheel's
  ``npu_rms_norm_meta``), computed in fp32 and rounded once; the constraints of :func:`_check_rms_norm`.

The values equal the stock ops' (bitwise on CPU); each computation is one ``torch.library`` custom op (one launch).
"""

from __future__ import annotations

from typing import Any

import torch


@torch.library.custom_op("fake_torch_npu::layer_norm_eval", mutates_args=())
def _layer_norm_eval_op(
    x: torch.Tensor, normalized_shape: list[int], weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float
) -> torch.Tensor:
    return torch.nn.functional.layer_norm(x, normalized_shape, weight, bias, eps)


@_layer_norm_eval_op.register_fake
def _(x, normalized_shape, weight, bias, eps):
    return torch.empty_like(x)


def npu_layer_norm_eval(
    input: torch.Tensor,
    normalized_shape: list[int],
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-05,
) -> torch.Tensor:
    """[OP-LNE] ``F.layer_norm(input, normalized_shape, weight, bias, eps)`` as one NPU kernel."""
    return _layer_norm_eval_op(input, [int(n) for n in normalized_shape], weight, bias, float(eps))


@torch.library.custom_op("fake_torch_npu::rms_norm", mutates_args=())
def _rms_norm_op(
    x: torch.Tensor, gamma: torch.Tensor, eps: float, ignore_gamma: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    dims = list(range(x.dim() - gamma.dim(), x.dim()))
    x32 = x.float()
    rstd = torch.rsqrt(x32.pow(2).mean(dims, keepdim=True).add_(eps))
    y = x32 * rstd
    if not ignore_gamma:
        y = y * gamma.float()
    return y.to(x.dtype), rstd


@_rms_norm_op.register_fake
def _(x, gamma, eps, ignore_gamma):
    shape = [x.shape[i] if i < x.dim() - gamma.dim() else 1 for i in range(x.dim())]
    return torch.empty_like(x), x.new_empty(shape, dtype=torch.float32)


def _check_rms_norm(x: torch.Tensor, gamma: torch.Tensor) -> None:
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise RuntimeError(f"npu_rms_norm: self must be float16, bfloat16 or float32, got {x.dtype} [OP-RMS]")
    if gamma.dtype != x.dtype:
        raise RuntimeError(f"npu_rms_norm: gamma's dtype {gamma.dtype} must equal self's {x.dtype} [OP-RMS]")
    if not 2 <= x.dim() <= 8:
        raise RuntimeError(f"npu_rms_norm: self must have 2-8 dims, got {x.dim()} [OP-RMS]")
    if gamma.dim() > x.dim() or tuple(gamma.shape) != tuple(x.shape[x.dim() - gamma.dim() :]):
        raise RuntimeError(
            f"npu_rms_norm: gamma {tuple(gamma.shape)} must be the trailing dims of self {tuple(x.shape)} [OP-RMS]"
        )


def npu_rms_norm(self: torch.Tensor, gamma: torch.Tensor, epsilon: float = 1e-06) -> tuple[torch.Tensor, torch.Tensor]:
    """[OP-RMS] ``(x * rstd * gamma, rstd)`` with ``rstd = rsqrt(mean(x^2) + epsilon)`` over gamma's dims."""
    _check_rms_norm(self, gamma)
    return _rms_norm_op(self, gamma, float(epsilon), False)


def _rms_norm_ignoring_gamma(self, gamma, epsilon=1e-06):
    """A wrong kernel (for tests): normalizes but never multiplies by gamma."""
    _check_rms_norm(self, gamma)
    return _rms_norm_op(self, gamma, float(epsilon), True)


def _rms_norm_raising(self, gamma, epsilon=1e-06):
    """A kernel that fails at run time (for tests), as an unsupported tiling would."""
    raise RuntimeError("npu_rms_norm: EZ9999 fake tiling failure")


#: kernel name -> {variant: implementation}; "correct" follows the documentation.
VARIANTS: dict[str, dict[str, Any]] = {
    "npu_layer_norm_eval": {"correct": npu_layer_norm_eval},
    "npu_rms_norm": {"correct": npu_rms_norm, "no_gamma": _rms_norm_ignoring_gamma, "raises": _rms_norm_raising},
}
