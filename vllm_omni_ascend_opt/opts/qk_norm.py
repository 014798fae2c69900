"""`qk_norm`: Qwen-Image's four QK RMSNorms per block as ``torch_npu.npu_rms_norm``, verified per shape class.

The kernel path is ``blocks.kernels.rms_norm.RmsNormPath``; this module swaps the norm class in per model instance
and offers the path in the ``NORM`` slot while installed (``joint_attention`` asks ``rms_norm.kernel_ready``).
"""

from __future__ import annotations

import sys
from typing import Any

import torch.nn as nn

from vllm_omni_ascend_opt import _backend
from vllm_omni_ascend_opt.blocks.kernels import rms_norm
from vllm_omni_ascend_opt.blocks.kernels.verdicts import Verdict
from vllm_omni_ascend_opt.blocks.upstream import targets as _targets
from vllm_omni_ascend_opt.optimization import Optimization

KERNEL = rms_norm.RmsNormPath.kernel
NORM_NAMES = ("norm_q", "norm_k", "norm_added_q", "norm_added_k")


class QkNorm(Optimization):
    name = "qk_norm"
    summary = "Run Qwen-Image's four QK RMSNorms per block as torch_npu.npu_rms_norm, verified per shape class against an fp32 reference."
    why = "torch_npu has no aten::rms_norm: each QK RMSNorm runs as 8 bf16 kernels on an NPU, npu_rms_norm as one."
    how = (
        "npu_rms_norm(x, weight, epsilon=eps)[0] within its documented constraints, verified on the first call of "
        "each shape class against an fp32 reference (one rounding, 2x headroom); stock nn.RMSNorm where refused, "
        "under autograd, tracing or graph capture: pixel."
    )
    upstream_pr = "None for Qwen-Image on NPU (#7594 is CUDA-only); vllm-ascend uses npu_rms_norm for LLMs."
    equivalence = "pixel"
    requires = ("torch_npu with npu_rms_norm (float16/bfloat16/float32)",)
    target_modules = (_targets.TRANSFORMER,)
    regions = frozenset({"block"})
    watches_forwards = True  # the fault-backoff clock counts its forwards
    removal_plan = "Drop when torch_npu registers aten::rms_norm for NPU or vLLM-Omni's Qwen-Image uses an NPU RMSNorm."
    upstream = (_targets.QK_NORM_ROPE, _targets.CROSS_ATTENTION_INIT)
    on_qwen_image_21 = (
        "its QK norms are diffusers' RMSNorm, which already calls torch_npu.npu_rms_norm whenever torch_npu imports"
    )

    def __init__(self) -> None:
        super().__init__()
        self.path = rms_norm.RmsNormPath(self.name, self.stats)

    def _process_reasons(self) -> list[str]:
        if _backend.torch_npu_module() is None:
            return _backend.npu_unavailable_reasons() or ["torch_npu unavailable"]
        if self.path.function() is None:
            return [f"{_backend.backend_label()} has no {KERNEL}"]
        return []

    def _model_reasons(self, model: nn.Module) -> list[str]:
        if not (norms := _qk_norms(model)):
            return ["no QwenImageCrossAttention with nn.RMSNorm QK norms in this model"]
        if not any(n in self._swapped for n in norms):
            return ["not attached to this model's QK norms"]
        verdicts = self.verdicts()
        if verdicts and not any(v.ok for v in verdicts):
            return [f"{KERNEL} refused at every shape class so far: {verdicts[0].reason}"]
        return []

    def tier(self) -> str:
        """``pixel`` where the kernel runs (or will, once verified); ``exact`` where it cannot (nothing changes)."""
        verdicts = self.verdicts()
        return "exact" if self.reasons_inactive() or (verdicts and not any(v.ok for v in verdicts)) else "pixel"

    def notes(self) -> list[str]:
        out = self.path.notes() if self.kernel_classes() is not None else []
        return [*out, f"{KERNEL} calls {self.stats['kernel_calls']}, stock calls {self.stats['stock_calls']}"]

    def cache_memory(self) -> dict[str, Any]:
        """No cache; the fp32 scratch peak its checks were sized to."""
        return {"bytes": 0, "check_scratch_peak_bytes": self.path.guard.scratch_peak}

    def kernel_classes(self) -> dict[str, Any] | None:
        return None if self._process_reasons() else self.path.tally()

    def verdicts(self) -> list[Verdict]:
        """The per-shape-class checks of the kernel so far (for the current backend probe)."""
        return self.path.classes.values()

    def _install(self) -> None:
        rms_norm.NORM.provide(self.path)

    def _uninstall(self) -> None:
        rms_norm.NORM.withdraw(self.path)
        self.path.clear()

    def _attach(self, model: nn.Module) -> None:
        for n in _qk_norms(model):
            self._swap_class(n, nn.RMSNorm, rms_norm.KernelRMSNorm)

    def _detach(self, model: nn.Module) -> None:
        for n in _qk_norms(model):
            self._restore_class(n)


def _qk_norms(model: Any) -> list[nn.Module]:
    if (mod := sys.modules.get(_targets.TRANSFORMER)) is None or not isinstance(model, nn.Module):
        return []
    attns = [m for m in model.modules() if isinstance(m, mod.QwenImageCrossAttention)]
    return [n for m in attns for n in (getattr(m, name, None) for name in NORM_NAMES) if isinstance(n, nn.RMSNorm)]


OPT = QkNorm()
