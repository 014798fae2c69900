"""How vLLM-Omni's ``AdaLayerNorm`` instances apply ``(scale, shift)``: the one place that looks at their dispatch
(the block body reproduces each kind, the memo keys on it, the fast tier replaces the native and NPU kinds)."""

from __future__ import annotations

import sys
from typing import Any

import torch.nn as nn

from vllm_omni_ascend_opt import _backend
from vllm_omni_ascend_opt.blocks.upstream import forward_scope, targets

ADALAYERNORM_MODULE, CUSTOM_OP_MODULE = targets.ADALAYERNORM, targets.CUSTOM_OP
NATIVE = "native"  # layernorm(x) * (1 + scale) + shift, with the instance's own LayerNorm
NPU_EVAL = "npu_eval"  # torch_npu.npu_layer_norm_eval(x, ...) * (1 + scale) + shift
OPAQUE = "opaque"  # anything else (MindIE-SD fused kernel, patched instance): call norm(x, scale, shift)


def norm_kind(norm: nn.Module) -> str:
    """How ``norm`` (vLLM-Omni's AdaLayerNorm) applies (scale, shift)."""
    return norm_kinds(norm)[0]


def norm_kinds(*norms: nn.Module) -> tuple[str, ...]:
    """:func:`norm_kind` of each of ``norms`` (a block's four), the class facts asked once."""
    ada, native, npu_eval = forward_scope.decide("ada_norm.methods", _methods)
    kinds = []
    for norm in norms:
        kind = OPAQUE
        if type(norm) is ada and native is not None and not (norm._forward_hooks or norm._forward_pre_hooks):
            fn = getattr(norm.__dict__.get("_forward_method"), "__func__", None)
            if fn in native:
                kind = NATIVE
            elif fn is not None and fn is npu_eval:
                kind = NPU_EVAL
        kinds.append(kind)
    return tuple(kinds)


def _methods() -> tuple[type, frozenset[Any] | None, Any]:
    """Class facts: ``(AdaLayerNorm, methods computing forward_native exactly, forward_npu if the eval kernel's)``."""
    ada_module = sys.modules[ADALAYERNORM_MODULE]
    ada = ada_module.AdaLayerNorm
    if ada.forward is not sys.modules[CUSTOM_OP_MODULE].CustomOp.forward:
        return ada, None, None  # the class's forward is not CustomOp's dispatch: every instance is OPAQUE
    # forward_native, the class's own forward_hip / forward_musa, and forward_cuda unless it can take the fused
    # Triton AdaLN kernel (its reductions are not F.layer_norm's: then it is OPAQUE).
    native = [ada.forward_native]
    native += [vars(ada)[n] for n in ("forward_hip", "forward_musa") if n in vars(ada)]  # own, not CustomOp's
    if getattr(ada_module, "_adaln_fused_forward", None) is None:
        native.append(ada.forward_cuda)
    npu = not getattr(ada_module, "_HAS_MINDIESD", True) and _backend.torch_npu_module()
    return ada, frozenset(native), ada.forward_npu if npu else None
