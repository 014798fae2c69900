"""Fake torch_npu kernels: normalization (``npu_layer_norm_eval``).

Sources (see ``__init__``):

* [OP-LNE] the torch-npu 2.13.0 wheel, ``torch_npu/_op_plugin_docs.py``: ``torch_npu.npu_layer_norm_eval(input,
  normalized_shape, weight=None, bias=None, eps=1e-05) -> Tensor``, "与torch.nn.functional.layer_norm相同, 优化NPU设备实现"
  (the same as ``F.layer_norm``, an NPU implementation); schema ``npu_layer_norm_eval(Tensor input, int[]
  normalized_shape, Tensor? weight=None, Tensor? bias=None, float eps=1e-05) -> Tensor`` (first argument named
  ``input`` here, unlike most ops); meta: ``empty_like(input)``.

The value equals ``F.layer_norm`` (bitwise on CPU), so a test cannot tell the two apart by their numbers: the fake's
call log (``torch_npu.calls["npu_layer_norm_eval"]``) is what shows that the NPU path was taken. The computation is
one ``torch.library`` custom op, so an op counter sees one launch.
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


#: kernel name -> {variant: implementation}; "correct" follows the documentation.
VARIANTS: dict[str, dict[str, Any]] = {"npu_layer_norm_eval": {"correct": npu_layer_norm_eval}}
