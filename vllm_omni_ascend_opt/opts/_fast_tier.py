"""The fast tier's common base: close-tier modes of ``shared_modulation``'s memoized block body.

Each fast-tier optimization (``fast_modulate``, ``fast_residual``) is its own flag, off by default and part of
``all``. It patches nothing itself: ``install`` turns its mode on in :data:`shared_modulation.FAST`, which the block
body of ``shared_modulation`` reads on every call; without ``shared_modulation`` the stock block runs and the mode
does nothing (``needs``: its reasons become this one's). Gated by SSIM >= 0.999 and PSNR >= 45 dB against the
configuration without it (:attr:`close_gates`): these are last-bit changes (1 ulp in bf16), far inside the VAE
tier's gates.
"""

from __future__ import annotations

from typing import Any, ClassVar

from vllm_omni_ascend_opt.blocks import targets as _targets
from vllm_omni_ascend_opt.optimization import Optimization
from vllm_omni_ascend_opt.opts import shared_modulation as sm

#: The fast tier's gates (SSIM, PSNR dB): tighter than the workload's defaults (0.99 / 35 dB, sized for vae_fast).
FAST_TIER_GATES = (0.999, 45.0)


class FastBlockMode(Optimization):
    """A close-tier mode of shared_modulation's block body (subclasses set ``name``, ``summary``, ``mode``)."""

    mode: ClassVar[str]
    equivalence = "close"
    default_enabled = False
    close_gates = FAST_TIER_GATES
    needs = ("shared_modulation",)
    regions = frozenset({"block"})
    acts_without_attach = True
    requires = ("shared_modulation active (a mode of its memoized block body); vLLM-Omni 0.30.x; any device",)
    target_modules = (_targets.TRANSFORMER,)

    def _model_reasons(self, model: Any) -> list[str]:
        return [
            f"{why}: {self.name} is a mode of shared_modulation's block body"
            for tr in sm._find_transformers(model)
            if (why := sm.block_body_reason(tr))
        ]

    def ran(self) -> int:
        """Calls that took this fast path since the last :meth:`reset_stats`."""
        return sm.FAST.stats[self.mode]

    def fallback_reasons(self) -> dict[str, int]:
        """Why calls in shared_modulation's block body kept stock's ops (reason -> calls)."""
        return dict(sm.FAST.fallbacks[self.mode])

    def reset_stats(self) -> None:
        super().reset_stats()
        sm.FAST.reset(self.mode)

    def _install(self) -> None:
        sm.FAST.set(self.mode, True)

    def _uninstall(self) -> None:
        sm.FAST.set(self.mode, False)
        sm.FAST.reset(self.mode)
