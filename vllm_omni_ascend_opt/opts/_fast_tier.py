"""The fast tier's common base: close-tier modes of the memoized block body (``blocks/body/block_body.py``).

Each mode is its own flag, off by default, and patches nothing: ``install`` provides it in its slot, and the block
body that ``shared_modulation`` runs reports each call to it (``ModeOwner``). Gated by :attr:`close_gates`.
"""

from __future__ import annotations

from typing import Any, ClassVar

from vllm_omni_ascend_opt.blocks.body.block_body import ModeOwner, block_body_reason
from vllm_omni_ascend_opt.blocks.slots import Slot
from vllm_omni_ascend_opt.blocks.upstream import targets as _targets
from vllm_omni_ascend_opt.blocks.upstream.guards import find_transformers
from vllm_omni_ascend_opt.optimization import Optimization

#: The fast tier's gates (SSIM, PSNR dB), tighter than the workload's defaults (sized for vae_fast).
FAST_TIER_GATES = (0.999, 45.0)


class FastBlockMode(Optimization):
    """A close-tier mode of the memoized block body (subclasses set ``name``, ``summary``, ``slot``)."""

    slot: ClassVar[Slot[ModeOwner]]
    equivalence = "close"
    default_enabled = False
    close_gates = FAST_TIER_GATES
    needs = ("shared_modulation",)
    regions = frozenset({"block"})
    acts_compiled = frozenset({"regional"})
    acts_without_attach = True
    requires = ("shared_modulation active (a mode of its memoized block body); any device",)
    target_modules = (_targets.TRANSFORMER,)
    on_qwen_image_21 = (
        "upstream's own NPU path there already runs its modulation and gated residuals in place "
        "(mul_/add_, in the bf16 roundings it keeps on purpose); a mode of shared_modulation, which stays off there"
    )

    def _model_reasons(self, model: Any) -> list[str]:
        return [
            f"{why}: {self.name} is a mode of shared_modulation's block body"
            for tr in find_transformers(model)
            if (why := block_body_reason(tr))
        ]

    def ran(self) -> int:
        """Calls that took this fast path since the last :meth:`reset_stats`."""
        return self.stats["ran"]

    def count_fast(self) -> None:
        self.stats["ran"] += 1

    count_stock = Optimization._fallback  # one frame fewer per stock call of the block body

    def _install(self) -> None:
        self.slot.provide(self)

    def _uninstall(self) -> None:
        self.slot.withdraw(self)
