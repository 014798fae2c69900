"""How vLLM-Omni's ``AdaLayerNorm`` instances apply ``(scale, shift)``: the one place that looks at their dispatch
(the block body reproduces each kind, the memo keys on it, the fast tier replaces the native and NPU kinds)."""

from __future__ import annotations

import sys

import torch.nn as nn

from vllm_omni_ascend_opt import _backend
from vllm_omni_ascend_opt.blocks.upstream import targets

ADALAYERNORM_MODULE, CUSTOM_OP_MODULE = targets.ADALAYERNORM, targets.CUSTOM_OP
NATIVE = "native"  # layernorm(x) * (1 + scale) + shift, with the instance's own LayerNorm
NPU_EVAL = "npu_eval"  # torch_npu.npu_layer_norm_eval(x, ...) * (1 + scale) + shift
OPAQUE = "opaque"  # anything else (MindIE-SD fused kernel, patched instance): call norm(x, scale, shift)


def norm_kind(norm: nn.Module) -> str:
    """How ``norm`` (vLLM-Omni's AdaLayerNorm) applies (scale, shift)."""
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
    # The methods that compute forward_native exactly: it, the class's own forward_hip / forward_musa, and forward_cuda
    # unless it can take the fused Triton AdaLN kernel (its reductions are not F.layer_norm's: then it is OPAQUE).
    native = [ada.forward_native]
    native += [vars(ada)[n] for n in ("forward_hip", "forward_musa") if n in vars(ada)]  # own, not CustomOp's
    if getattr(ada_module, "_adaln_fused_forward", None) is None:
        native.append(ada.forward_cuda)
    if fn in native:
        return NATIVE
    if fn is ada.forward_npu and not getattr(ada_module, "_HAS_MINDIESD", True) and _backend.torch_npu_module():
        return NPU_EVAL
    return OPAQUE
