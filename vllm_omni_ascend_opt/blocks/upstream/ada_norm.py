"""How vLLM-Omni's ``AdaLayerNorm`` instances apply ``(scale, shift)``: the one place that looks at their dispatch.

The memoized block body reproduces each kind with stock's ops, the memo keys on the kinds, and the fast tier's affine
layer norm replaces the native and NPU kinds. ``shared_modulation`` fingerprints each dispatch target (per platform).
"""

from __future__ import annotations

import sys
from typing import Any

import torch.nn as nn

from vllm_omni_ascend_opt import _backend
from vllm_omni_ascend_opt.blocks.upstream import targets

ADALAYERNORM_MODULE = targets.ADALAYERNORM
CUSTOM_OP_MODULE = targets.CUSTOM_OP
# How an AdaLayerNorm instance applies (scale, shift); decided in one place: norm_kind().
NATIVE = "native"  # layernorm(x) * (1 + scale) + shift, with the instance's own LayerNorm
NPU_EVAL = "npu_eval"  # torch_npu.npu_layer_norm_eval(x, ...) * (1 + scale) + shift
OPAQUE = "opaque"  # anything else (MindIE-SD fused kernel, patched instance): call norm(x, scale, shift)


def native_forwards(ada_module: Any) -> tuple[Any, ...]:
    """The ``AdaLayerNorm`` methods that compute ``forward_native`` exactly (kind :data:`NATIVE`): ``forward_native``
    itself, ``forward_hip`` and (0.32.0rc1+) ``forward_musa`` where the class defines them as it, and
    ``forward_cuda`` only where it has no fused kernel to take: 0.32.0rc1 routes it to a CUDA Triton AdaLN kernel
    (``_adaln_fused_forward``, None without Triton) whose mean/variance reductions are not ``F.layer_norm``'s, so
    with that kernel the instance is called as it is (:data:`OPAQUE`, still exact). Before 0.32 the module has no
    ``_adaln_fused_forward`` and ``forward_cuda`` is ``forward_native``."""
    ada = ada_module.AdaLayerNorm
    out = [ada.forward_native]
    out += [vars(ada)[n] for n in ("forward_hip", "forward_musa") if n in vars(ada)]  # own, not CustomOp's
    if getattr(ada_module, "_adaln_fused_forward", None) is None:
        out.append(ada.forward_cuda)
    return tuple(out)


def norm_kind(norm: nn.Module) -> str:
    """How ``norm`` (vLLM-Omni's AdaLayerNorm) applies (scale, shift) -- the one place that looks at the backend."""
    ada_module = sys.modules[ADALAYERNORM_MODULE]
    ada = ada_module.AdaLayerNorm
    if (
        type(norm) is not ada
        or norm._forward_hooks
        or norm._forward_pre_hooks
        or ada.forward is not sys.modules[CUSTOM_OP_MODULE].CustomOp.forward
    ):
        return OPAQUE
    fn = getattr(norm.__dict__.get("_forward_method"), "__func__", None)
    if fn is ada.forward_native or fn in native_forwards(ada_module):
        return NATIVE
    if fn is ada.forward_npu and not getattr(ada_module, "_HAS_MINDIESD", True) and _backend.torch_npu_module():
        return NPU_EVAL
    return OPAQUE
