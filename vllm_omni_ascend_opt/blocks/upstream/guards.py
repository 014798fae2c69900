"""Guards: when patched code must run stock code, and which parts of a model are compiled. Patched code asks
:func:`tracing` before anything else (nothing mutable is touched inside a traced forward), then :func:`call_reason`.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.nn as nn
from torch.nn.modules import module as _torch_module

from vllm_omni_ascend_opt import _backend
from vllm_omni_ascend_opt.blocks.upstream import forward_scope, targets


def tracing() -> bool:
    """torch.compile (dynamo) is tracing this call. Patched code returns to stock code at once when it is."""
    return torch.compiler.is_compiling()


def global_hooks() -> bool:
    """Global ``nn.Module`` forward (pre-)hooks are registered (skipping a module would skip them)."""
    return bool(_torch_module._global_forward_hooks or _torch_module._global_forward_pre_hooks)


def hooked(module: nn.Module) -> bool:
    """``module`` carries forward (pre-)hooks of its own."""
    return bool(module._forward_hooks or module._forward_pre_hooks)


def call_reason(*grad_tensors: torch.Tensor, any_grad: bool = False, hooks: bool = True) -> str | None:
    """Why patched code must run stock code for this call, or None: autograd (``any_grad``: any; else through one of
    ``grad_tensors``); graph capture and global module hooks (``hooks``), once per forward."""
    if torch.is_grad_enabled() and (any_grad or any(t.requires_grad for t in grad_tensors)):
        return "autograd is recording"
    if hooks:
        return forward_scope.decide("guards.capture_or_hooks", _capture_or_hooks_reason)
    return forward_scope.decide("guards.capture", _backend.graph_capture_reason)


def _capture_or_hooks_reason() -> str | None:
    """Process-wide, the same for the whole forward: a graph capture, then global module hooks."""
    why = _backend.graph_capture_reason()
    if why is None and global_hooks():
        return "global nn.Module forward hooks are registered"
    return why


def _is_compiled(fn: Any) -> bool:
    return getattr(fn, "_torchdynamo_orig_callable", None) is not None


def block_compiled(block: nn.Module) -> bool:
    """``block`` or its forward (or what its hook registry dispatches to) is compiled (regional compile)."""
    d = block.__dict__
    return getattr(block, "_compiled_call_impl", None) is not None or any(
        _is_compiled(f) for f in (d.get("forward"), d.get("_omni_original_forward"))
    )


def find_transformers(model: Any) -> list[nn.Module]:
    """The QwenImageTransformer2DModel instances in ``model`` (a pipeline, a transformer, or any module tree)."""
    t = sys.modules.get(targets.TRANSFORMER)
    if t is None:
        return []
    cls = t.QwenImageTransformer2DModel
    if isinstance(model, cls):
        return [model]
    tr = getattr(model, "transformer", None)
    found = [tr] if isinstance(tr, cls) else []
    if isinstance(model, nn.Module):
        found.extend(m for m in model.modules() if isinstance(m, cls) and m is not tr)
    return found


def compiled_regions(model: Any) -> frozenset[str]:
    """The regions of ``model`` that torch.compile runs: ``{"block"}``, plus ``"transformer"`` when fully compiled."""
    out: set[str] = set()
    for tr in find_transformers(model):
        if getattr(tr, "_compiled_call_impl", None) is not None or _is_compiled(tr.__dict__.get("forward")):
            return frozenset({"block", "transformer"})
        if any(block_compiled(block) for block in getattr(tr, "transformer_blocks", ())):
            out.add("block")
    return frozenset(out)


def compile_reason(
    regions: frozenset[str], model: Any, name: str, acts_compiled: frozenset[str] = frozenset()
) -> str | None:
    """Why an optimization in ``regions`` does not act on ``model`` because torch.compile runs all of them, or None."""
    compiled = compiled_regions(model)
    full = "transformer" in compiled  # the whole transformer ("full"), else its blocks ("regional")
    if not regions or not regions <= compiled or ("full" if full else "regional") in acts_compiled:
        return None
    where = "the whole transformer" if full else "the transformer blocks"
    return (
        f"torch.compile runs {where} ({', '.join(sorted(compiled))}): {name} steps aside while dynamo traces, "
        "so the compiled graphs hold stock code"
    )


def eager_call_reason() -> str | None:
    """:func:`call_reason` for patched code that needs no autograd and ignores global hooks."""
    return call_reason(any_grad=True, hooks=False)
