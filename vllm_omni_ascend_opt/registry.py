"""The optimization registry: one :class:`Optimization` per swappable change, in a fixed order.

Each optimization has metadata (summary, equivalence tier, default, requirements, parallel-mode support), can say
in words why it cannot be active here (:meth:`Optimization.reasons_inactive`, in the style of xformers'
``not_supported_reasons``), and two levels of switches:

* ``install()`` / ``uninstall()``: process-wide patches of upstream classes and module globals. The plugin calls
  ``install`` as soon as the modules named in ``target_modules`` are imported, i.e. before any model is built.
* ``attach(model)`` / ``detach(model)``: per-instance work on a built pipeline or transformer (weight casts, swapped
  attention implementations, VAE submodules). The plugin attaches every installed optimization to each pipeline
  vLLM-Omni's loader returns; the Python API attaches to models you pass it.

Both levels are idempotent and restore the originals by identity (see :mod:`vllm_omni_ascend_opt._patching`).
"""

from __future__ import annotations

import logging
import sys
import weakref
from typing import ClassVar, Literal

import torch.nn as nn

from vllm_omni_ascend_opt._patching import PatchSet

logger = logging.getLogger("vllm_omni_ascend_opt")

Equivalence = Literal["exact", "pixel", "close"]
#: Equivalence tiers, strongest first. ``exact``: bitwise-identical outputs; ``pixel``: the uint8 images are identical
#: (float outputs may differ in the last bits); ``close``: the images pass the SSIM/PSNR gates.
TIERS: tuple[str, ...] = ("exact", "pixel", "close")
TIER_MEANING = {
    "exact": "bitwise-identical outputs",
    "pixel": "uint8-identical images (float outputs may differ)",
    "close": "images within the SSIM/PSNR gates",
}


def weakest_tier(tiers: list[str] | tuple[str, ...] | set[str]) -> str:
    """The weakest of ``tiers`` (``exact`` for none): what a configuration containing them can promise."""
    return max(tiers, key=TIERS.index, default="exact")


#: Parallel modes an optimization may be asked about (vLLM-Omni's names).
PARALLEL_MODES = ("single", "ulysses", "ring", "cfg_parallel", "tensor_parallel")


class Optimization:
    """Base class. Subclasses set the class attributes and override the hooks they need."""

    name: ClassVar[str]
    summary: ClassVar[str]
    #: The weakest tier this optimization can deliver anywhere (its class); :meth:`tier` says what it delivers here.
    equivalence: ClassVar[Equivalence]
    default_enabled: ClassVar[bool] = True
    #: Human-readable requirements, shown by ``list``.
    requires: ClassVar[tuple[str, ...]] = ()
    #: Modules whose import triggers ``install`` (all must be fully imported first).
    target_modules: ClassVar[tuple[str, ...]] = ()
    #: Per parallel mode: "supported", or "off: <reason>" when the optimization turns itself off there.
    parallel_support: ClassVar[dict[str, str]] = {m: "supported" for m in PARALLEL_MODES}
    #: Upstream change that makes this optimization obsolete (shown in docs and patches).
    removal_plan: ClassVar[str] = ""
    #: ``(SSIM, PSNR dB)`` this optimization must meet against the configuration without it when it delivers the
    #: ``close`` tier (the ablation runner's gate); None: the workload's ``ssim_gate`` / ``psnr_gate``.
    close_gates: ClassVar[tuple[float, float] | None] = None
    #: Optimizations this one acts through (it does nothing without them): the ablation planner keeps them in every
    #: configuration that has this one (a leave-one-out of a needed one also leaves out its dependents).
    needs: ClassVar[tuple[str, ...]] = ()

    def __init__(self) -> None:
        self.patches = PatchSet(self.name)
        self._installed = False
        self._attached: weakref.WeakSet[nn.Module] = weakref.WeakSet()

    # ----- what can run here -------------------------------------------------------------------------------
    def reasons_inactive(self) -> list[str]:
        """Why this optimization cannot be active in this process (empty list: it can).

        Environment-level reasons only (missing torch_npu, unsupported version, failed kernel verification).
        Per-model reasons (dtype, offload, parallel mode) are reported by :meth:`model_reasons_inactive`.
        """
        return []

    def model_reasons_inactive(self, model: nn.Module) -> list[str]:
        """Why this optimization does nothing for ``model`` even when installed (empty list: it acts)."""
        return []

    def notes(self) -> list[str]:
        """Extra facts for ``list`` (e.g. which kernel path is in use and why), not reasons to be off."""
        return []

    def tier(self) -> Equivalence:
        """The equivalence tier this optimization delivers in this process (``list``, ``status()``, the ablation
        gates). Default: its class, :attr:`equivalence`; optimizations whose paths differ per backend override it
        (``rope``: ``exact`` on the portable path, ``pixel`` with the NPU kernel)."""
        return self.equivalence

    # ----- process-wide patches ----------------------------------------------------------------------------
    @property
    def installed(self) -> bool:
        return self._installed

    def targets_imported(self) -> bool:
        return all(_fully_imported(m) for m in self.target_modules)

    def install(self) -> None:
        """Patch upstream classes/globals. Idempotent. Raises if the targets are not importable."""
        if self._installed:
            return
        self._install()
        self._installed = True
        logger.debug("installed %s", self.name)

    def uninstall(self) -> None:
        """Detach from every model, then restore every patched attribute by identity. Idempotent."""
        for model in list(self._attached):
            self.detach(model)
        self.patches.revert()
        self._uninstall()
        self._installed = False

    def _install(self) -> None:
        """Override: make the process-wide patches through ``self.patches``."""

    def _uninstall(self) -> None:
        """Override: drop state kept outside ``self.patches`` (caches)."""

    # ----- per-instance work -------------------------------------------------------------------------------
    def attach(self, model: nn.Module) -> None:
        """Apply per-instance work to a built pipeline or transformer. Idempotent."""
        if model in self._attached:
            return
        self._attach(model)
        self._attached.add(model)

    def detach(self, model: nn.Module) -> None:
        """Undo :meth:`attach` on ``model``. Idempotent."""
        if model not in self._attached:
            return
        self._detach(model)
        self._attached.discard(model)

    def is_attached(self, model: nn.Module) -> bool:
        return model in self._attached

    def _attach(self, model: nn.Module) -> None:
        """Override for per-instance work."""

    def _detach(self, model: nn.Module) -> None:
        """Override for per-instance work."""

    def __repr__(self) -> str:
        return f"<Optimization {self.name} ({self.tier()}, installed={self._installed})>"


def _fully_imported(module_name: str) -> bool:
    mod = sys.modules.get(module_name)
    if mod is None:
        return False
    spec = getattr(mod, "__spec__", None)
    return not getattr(spec, "_initializing", False)


_REGISTRY: dict[str, Optimization] = {}


def register_optimization(opt: Optimization) -> Optimization:
    """Add ``opt`` to the registry (registry order is the order of ``list`` and of cumulative ablations)."""
    if opt.name in _REGISTRY and _REGISTRY[opt.name] is not opt:
        raise ValueError(f"optimization {opt.name!r} is registered twice")
    _REGISTRY[opt.name] = opt
    return opt


def _ensure_loaded() -> None:
    if not _REGISTRY:
        import vllm_omni_ascend_opt.opts  # noqa: F401  (registers the built-in optimizations)


def all_optimizations() -> list[Optimization]:
    _ensure_loaded()
    return list(_REGISTRY.values())


def names() -> list[str]:
    return [o.name for o in all_optimizations()]


def get(name: str) -> Optimization:
    _ensure_loaded()
    try:
        return _REGISTRY[name]
    except KeyError:
        raise KeyError(f"unknown optimization {name!r}; valid names: {', '.join(_REGISTRY)}") from None


def default_names() -> list[str]:
    return [o.name for o in all_optimizations() if o.default_enabled]
