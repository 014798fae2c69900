"""The kernel RMSNorm class and its readiness, written once (``qk_norm`` attaches it, ``joint_attention`` asks it).

``qk_norm`` swaps Qwen-Image's QK norms to :class:`KernelRMSNorm` (same object, same parameters), whose forward runs
``torch_npu.npu_rms_norm``. ``joint_attention`` must know, without importing ``qk_norm``, that such a norm is still an
RMSNorm it may replace by its bitwise joint norm (:data:`RMS_NORM_CLASSES`), and whether the kernel is ready for all
four norms of an attention layer (:func:`kernel_ready`: then it takes the per-stream order, one kernel per stream).

The owner of the kernel registers a :class:`NormKernel` (:func:`provide` on install, :func:`withdraw` on uninstall);
it counts into its own statistics and answers None where stock must run.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
import torch.nn as nn

from vllm_omni_ascend_opt.blocks.upstream import guards


class NormKernel(Protocol):
    """What the owner of the kernel answers (``qk_norm``)."""

    def apply(self, norm: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
        """``norm(x)`` through the kernel, or None (stock ``nn.RMSNorm.forward`` runs)."""
        ...

    def ready(self, norms: Sequence[nn.Module | None]) -> bool:
        """Every norm in ``norms`` is prepared for the kernel, and the kernel exists in this process."""
        ...


_PROVIDER: list[NormKernel] = []


def provide(kernel: NormKernel) -> None:
    """Route :class:`KernelRMSNorm` calls to ``kernel`` (its owner's install)."""
    _PROVIDER[:] = [kernel]


def withdraw(kernel: NormKernel) -> None:
    """Stop routing to ``kernel`` (its owner's uninstall); a no-op when another one provides."""
    if _PROVIDER and _PROVIDER[0] is kernel:
        _PROVIDER.clear()


class KernelRMSNorm(nn.RMSNorm):
    """``nn.RMSNorm`` whose forward runs the provider's verified kernel where it can (swapped in per instance), and
    stock's forward while dynamo traces (nothing mutable is read)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if guards.tracing():
            return nn.RMSNorm.forward(self, x)
        y = _PROVIDER[0].apply(self, x) if _PROVIDER else None
        return nn.RMSNorm.forward(self, x) if y is None else y


#: The classes whose forward computes stock ``nn.RMSNorm`` (the kernel class falls back to it, or differs from it
#: only within the kernel's verified tolerance).
RMS_NORM_CLASSES: tuple[type[nn.Module], ...] = (nn.RMSNorm, KernelRMSNorm)


def kernel_ready(norms: Sequence[nn.Module | None]) -> bool:
    """Every norm in ``norms`` is prepared for the kernel and the kernel exists (False without a provider)."""
    return bool(_PROVIDER) and _PROVIDER[0].ready(norms)
