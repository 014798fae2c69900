"""What the modulation memo keys on, kept per module instance: the instance half of each signature is made once
per module and reused while its :class:`~.stamps.Stamp` holds; the weights' state (identity, version counter, dtype,
device) is read per call.

Why: the memo looks up every block, the time embedding and ``norm_out`` in every forward. Re-deriving what their
keys cover (the modules' classes, hooks, quantization method, LoRA state, which tensors) in each lookup cost more
host time than some of the kernels the memo saves; those facts only change when somebody changes the model.

How: :class:`MemoPlans` keeps one :class:`~.stamps.PlanCache` per kind of lookup. Each answer is a plan from
:mod:`.modulation_keys` / :mod:`.time_embedding`, why the module cannot be keyed (kept like an answer: the same
reads decide it), or None where a layer's tensors must be walked per call (LoRA wrappers, quantized layers: then
the whole check runs per call, as before). Class-level facts a stamp cannot see are re-checked here (the
AdaLayerNorm dispatch a block plan's kinds were decided with).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn as nn

from vllm_omni_ascend_opt.blocks import time_embedding
from vllm_omni_ascend_opt.blocks.modulation_keys import (
    PartsPlan,
    Unkeyable,
    ada_forward,
    block_parts,
    norm_out_plan,
    norm_out_sig,
    parts_plan,
    plan_sig,
)
from vllm_omni_ascend_opt.blocks.stamps import PlanCache


class MemoPlans:
    """The memo's per-instance plans: blocks (:func:`~.modulation_keys.block_parts`), time embeddings and
    ``norm_out``. Dropped with the memo (:meth:`clear`) on uninstall, detach and weight changes."""

    def __init__(self) -> None:
        self.parts = PlanCache()
        self.time = PlanCache()
        self.norm_out = PlanCache()

    def __len__(self) -> int:
        return len(self.parts) + len(self.time) + len(self.norm_out)

    def clear(self) -> None:
        self.parts.clear()
        self.time.clear()
        self.norm_out.clear()

    def block_parts(self, block: nn.Module) -> tuple[nn.Module, nn.Module, tuple[str, ...], tuple, tuple]:
        """:func:`~.modulation_keys.block_parts` of ``block``, its instance half from the block's plan. Raises
        :class:`~.modulation_keys.Unkeyable`."""
        plan = self.parts.get(block, functools.partial(parts_plan, block))
        if type(plan) is PartsPlan and plan.ada is not ada_forward():  # AdaLayerNorm's dispatch changed: new kinds
            self.parts.drop(block)
            plan = self.parts.get(block, functools.partial(parts_plan, block))
        if type(plan) is PartsPlan:
            return plan.parts(torch.is_grad_enabled())
        if plan is None:  # a layer whose tensors are walked per call
            return block_parts(block)
        raise Unkeyable(plan)

    def time_embedding(self, module: nn.Module) -> time_embedding.TimePlan:
        """:func:`~.time_embedding.time_embedding_plan` of ``module`` (made per call where a linear's tensors are
        walked per call). Raises :class:`~.modulation_keys.Unkeyable`."""
        plan = self.time.get(module, functools.partial(time_embedding.plan_or_reason, module))
        if isinstance(plan, str):
            raise Unkeyable(plan)
        return time_embedding.time_embedding_plan(module) if plan is None else plan

    def norm_out_sig(self, norm: nn.Module, grad: bool) -> tuple[Any, ...]:
        """:func:`~.modulation_keys.norm_out_sig` of ``norm``, its instance half from the plan. Raises
        :class:`~.modulation_keys.Unkeyable`."""
        plan = self.norm_out.get(norm, functools.partial(norm_out_plan, norm))
        if isinstance(plan, str):
            raise Unkeyable(plan)
        return norm_out_sig(norm, grad) if plan is None else plan_sig(plan, grad)
