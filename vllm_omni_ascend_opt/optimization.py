"""The :class:`Optimization` base: metadata, switches, and the one answer to "does it act here, and why not".

``install()`` / ``uninstall()`` patch upstream code process-wide once ``target_modules`` are imported; ``attach(model)``
/ ``detach(model)`` do the per-instance work. Both are idempotent and restore originals by identity. Every report asks
:meth:`Optimization.reasons_inactive`. No bookkeeping inside a traced forward: patched code checks ``guards.tracing``.
"""

from __future__ import annotations

import logging
import weakref
from collections import Counter
from typing import Any, ClassVar, Literal, Protocol

import torch.nn as nn

from vllm_omni_ascend_opt._parallel import parallel_reasons_inactive
from vllm_omni_ascend_opt._patching import PatchSet
from vllm_omni_ascend_opt.blocks.body.compiled_blocks import Hoister
from vllm_omni_ascend_opt.blocks.upstream import fingerprints as _upstream
from vllm_omni_ascend_opt.blocks.upstream import forward_scope, guards
from vllm_omni_ascend_opt.blocks.upstream.fingerprints import Upstream

logger = logging.getLogger("vllm_omni_ascend_opt")

Equivalence = Literal["exact", "pixel", "close"]
#: Strongest first: bitwise-identical outputs; identical uint8 images; images that pass the SSIM/PSNR gates.
TIERS: tuple[str, ...] = ("exact", "pixel", "close")

#: vLLM-Omni's parallel modes (``_parallel.active_modes``).
PARALLEL_MODES = ("single", "ulysses", "ring", "cfg_parallel", "tensor_parallel", "allgather", "vae_patch_parallel")

#: The stages of one request, in order.
STAGES: tuple[str, ...] = ("text_encode", "denoise", "vae_decode")
#: The stage each region's code can change (``load`` work changes what every transformer forward reads).
STAGE_OF_REGION = {"block": "denoise", "transformer": "denoise", "load": "denoise", "vae": "vae_decode"}


def weakest_tier(tiers: list[str] | tuple[str, ...] | set[str]) -> str:
    """The weakest of ``tiers`` (``exact`` for none): what a configuration containing them can promise."""
    return max(tiers, key=TIERS.index, default="exact")


class Peers(Protocol):
    """What an optimization may ask of the others (the registry)."""

    def get(self, name: str) -> Optimization: ...

    def weights_changed(self, model: Any = None, *, source: Optimization | None = None) -> None: ...


class Optimization:
    """Base class. Subclasses set the class attributes and override the hooks they need."""

    name: ClassVar[str]
    #: What it does, the stock work it removes, how (and why that keeps its tier), the upstream PRs, what obsoletes it.
    summary: ClassVar[str]
    why: ClassVar[str] = ""
    how: ClassVar[str] = ""
    upstream_pr: ClassVar[str] = ""
    removal_plan: ClassVar[str] = ""
    #: The weakest tier it can deliver anywhere; :meth:`tier` says what it delivers here.
    equivalence: ClassVar[Equivalence]
    default_enabled: ClassVar[bool] = True
    requires: ClassVar[tuple[str, ...]] = ()
    #: When it stays off or runs stock code, in a sentence.
    inactive_when: ClassVar[str] = ""
    #: Modules whose import triggers ``install`` (all must be fully imported first).
    target_modules: ClassVar[tuple[str, ...]] = ()
    #: Per parallel mode: "supported", or "off: <reason>" (a mode it does not mention is not supported).
    parallel_support: ClassVar[dict[str, str]] = dict.fromkeys(PARALLEL_MODES, "supported")
    #: Where the patched code runs: ``block``, ``transformer`` (outside the blocks), ``vae`` or ``load`` (the weights).
    regions: ClassVar[frozenset[str]] = frozenset()
    #: The request stages (:data:`STAGES`) whose time it can change; None: those of its :attr:`regions`.
    stages: ClassVar[frozenset[str] | None] = None
    #: Compile granularities (``"regional"``, ``"full"``) under which it acts inside the graphs; else it steps aside.
    acts_compiled: ClassVar[frozenset[str]] = frozenset()
    #: Its process-wide patches act on every model: no ``attach`` needed to act.
    acts_without_attach: ClassVar[bool] = False
    #: While attached, its transformers' forwards open a ``forward_scope`` (per-forward decisions, the fault clock).
    watches_forwards: ClassVar[bool] = False
    #: ``(SSIM, PSNR dB)`` a ``close`` one must meet without it (None: the workload's gates).
    close_gates: ClassVar[tuple[float, float] | None] = None
    #: Optimizations it acts through: inactive with their reasons when they are; the ablation planner keeps them.
    needs: ClassVar[tuple[str, ...]] = ()
    #: ``OmniDiffusionConfig`` fields (name -> value) without which it has nothing to act on.
    needs_config: ClassVar[dict[str, Any]] = {}
    #: Why it has no maintainers' patch in ``patches/`` (empty: it has one).
    no_patch_reason: ClassVar[str] = ""
    #: The upstream functions it patches, replaces or mirrors; it stays off where one differs (unless forced).
    upstream: ClassVar[tuple[Upstream, ...]] = ()
    #: Why it stays off on vLLM-Omni's Qwen-Image-2.1; "" when it handles 2.1 itself. Checked first for a model.
    on_qwen_image_21: ClassVar[str] = "it is written for Qwen-Image (1.x) and does not know this model"

    def __init__(self) -> None:
        self.patches = PatchSet(self.name)
        self._installed = False
        self._attached: weakref.WeakSet[nn.Module] = weakref.WeakSet()
        #: Counters of what ran (calls per path, cache hits, ...); cleared by :meth:`reset_stats`.
        self.stats: Counter[str] = Counter()
        self._fallbacks: Counter[str] = Counter()
        self._logged: set[str] = set()
        self._peers: Peers | None = None
        #: Hooks on the blocks of its watched transformers (registered at a forward's start, released on detach).
        self._hoister: Hoister | None = None
        #: Modules it gave one of its classes -> their own class (restored on detach and uninstall).
        self._swapped: weakref.WeakKeyDictionary[nn.Module, type] = weakref.WeakKeyDictionary()

    # ----- the one answer: does it act, and why not
    def reasons_inactive(self, model: Any = None) -> list[str]:
        """Why it does not act (empty: it does): in the process, or on ``model``."""
        reasons = self.upstream_reasons() + list(self._process_reasons()) + self._needs_reasons(None)
        if model is None:
            return list(dict.fromkeys(reasons))
        attached = self.is_attached(model)
        if why_21 := self.qwen_image_21_reason(model):
            reasons.insert(0, why_21)
        elif not self._installed and not attached:
            reasons = reasons or ["not installed"]
        elif not attached and not self.acts_without_attach:
            reasons.append("not attached to this model")
        else:
            reasons += self._needs_reasons(model)
            reasons += parallel_reasons_inactive(self, model)
            if why := guards.compile_reason(self.regions, model, self.name, self.acts_compiled):
                reasons.append(why)
            reasons += self._model_reasons(model)
        return list(dict.fromkeys(reasons))

    @classmethod
    def changed_stages(cls) -> tuple[str, ...]:
        """The stages whose time it can change, in :data:`STAGES` order (every stage when it declares no region)."""
        own = cls.stages if cls.stages is not None else {STAGE_OF_REGION[r] for r in cls.regions}
        return tuple(st for st in STAGES if st in own) if own else STAGES

    def _process_reasons(self) -> list[str]:
        """Override: environment-level reasons (missing torch_npu or kernels, bad settings)."""
        return []

    def upstream_reasons(self) -> list[str]:
        """Why the upstream code differs from what it knows; empty under ``VLLM_OMNI_ASCEND_OPT_FORCE``."""
        return [] if not self.upstream or _upstream.forced() else _upstream.reasons(self.upstream, self.name)

    def upstream_findings(self) -> list[_upstream.Finding]:
        """What each declared upstream function is here (fingerprint, the releases it matches, checked or not)."""
        return _upstream.check(self.upstream)

    def upstream_notes(self) -> list[str]:
        """For ``list``: how its upstream code matched, and under ``FORCE`` what it acts despite."""
        if not (findings := self.upstream_findings()):
            return []
        out = [_upstream.summary(findings)]
        if _upstream.forced():
            out += [f"{_upstream.ENV_FORCE}=1: acts although {f.reason(self.name)}" for f in findings if not f.ok]
        return out

    def qwen_image_21_reason(self, model: Any) -> str | None:
        """Why it stays off on ``model`` when that is vLLM-Omni's Qwen-Image-2.1 (None otherwise)."""
        cls = self.on_qwen_image_21 and _upstream.qwen_image_21(model)
        return f"Qwen-Image-2.1 ({cls}): {self.on_qwen_image_21}" if cls else None

    def _model_reasons(self, model: Any) -> list[str]:
        """Override: why this installed and attached optimization does nothing for ``model``."""
        return []

    def _needs_reasons(self, model: Any) -> list[str]:
        """The reasons of the optimizations it ``needs``: in this process (no model) or on ``model``."""
        if not self.needs or self._peers is None:
            return []
        out = []
        for name in self.needs:
            peer = self._peers.get(name)
            if model is not None and not peer.installed:
                out.append(f"{name} is not installed: {self.name} acts through it")
                continue
            out += [f"needs {name}, which is inactive here: {why}" for why in peer.reasons_inactive(model)]
        return out

    def notes(self) -> list[str]:
        """Extra facts for ``list`` (e.g. which kernel path is in use and why), not reasons to be off."""
        return []

    def tier(self) -> Equivalence:
        """The tier it delivers in this process: :attr:`equivalence`, unless its paths differ per backend."""
        return self.equivalence

    # ----- what it ran, what it holds
    def fallback_reasons(self) -> dict[str, int]:
        """Why calls ran stock code since the last :meth:`reset_stats` (reason -> number of calls)."""
        return dict(self._fallbacks)

    def reset_stats(self) -> None:
        self.stats.clear()
        self._fallbacks.clear()

    def kernel_classes(self) -> dict[str, Any] | None:
        """The shape classes on its device kernel, on stock, and why (``KernelPath.tally``); None without one."""
        return None

    def cache_memory(self) -> dict[str, Any] | None:
        """Memory its caches hold, with their budgets (``{"bytes": ..., ...}``); None when it keeps none."""
        return None

    def _fallback(self, why: str) -> None:
        """Count a call that ran stock code and log each distinct reason once (debug). Never while tracing."""
        self._fallbacks[why] += 1
        if why not in self._logged:
            self._logged.add(why)
            logger.debug("vllm-omni-ascend-opt: %s runs stock code: %s", self.name, why)

    # ----- events
    def bind_peers(self, peers: Peers) -> None:
        self._peers = peers

    def weights_changed(self, model: Any = None) -> None:
        """Hook: weights of ``model`` (None: any) changed behind the version counters; drop caches keyed on them."""

    def announce_weights_changed(self, model: Any = None) -> None:
        """Tell every other registered optimization that this one changed weights of ``model``."""
        if self._peers is not None:
            self._peers.weights_changed(model, source=self)

    # ----- process-wide patches
    @property
    def installed(self) -> bool:
        return self._installed

    def install(self) -> None:
        """Patch upstream classes/globals. Idempotent. Raises if the targets are not importable."""
        if self._installed:
            return
        self._install()
        self._installed = True
        logger.debug("installed %s", self.name)

    def uninstall(self) -> None:
        """Detach from every model, then restore every patched attribute by identity; drop stats. Idempotent."""
        for model in list(self._attached):
            self.detach(model)
        for module in list(self._swapped):
            self._restore_class(module)
        self.patches.revert()
        self._uninstall()
        self.reset_stats()
        self._logged.clear()
        self._installed = False

    def _install(self) -> None:
        """Override: make the process-wide patches through ``self.patches``."""

    def _uninstall(self) -> None:
        """Override: drop state kept outside ``self.patches`` (caches)."""

    # ----- per-instance work
    def attach(self, model: nn.Module) -> None:
        """Apply per-instance work to a built pipeline or transformer. Idempotent; nothing where it is off on 2.1."""
        if model in self._attached or self.qwen_image_21_reason(model):
            return
        on_forward = self._hoister.on_forward if self._hoister else None
        for tr in self._watched(model):
            forward_scope.watch(tr, self.name, on_forward=on_forward)
        self._attach(model)
        self._attached.add(model)

    def detach(self, model: nn.Module) -> None:
        """Undo :meth:`attach` on ``model``. Idempotent."""
        if model not in self._attached:
            return
        for tr in self._watched(model):
            forward_scope.unwatch(tr, self.name)
            if self._hoister:
                self._hoister.release(tr)
        self._detach(model)
        self._attached.discard(model)

    def is_attached(self, model: nn.Module) -> bool:
        return model in self._attached

    def _watched(self, model: nn.Module) -> list[nn.Module]:
        return guards.find_transformers(model) if self.watches_forwards else []

    def _swap_class(self, module: nn.Module, base: type, cls: type) -> None:
        """Give ``module`` the class ``cls`` when it is exactly a ``base`` (and not swapped already)."""
        if type(module) is base and module not in self._swapped:
            self._swapped[module] = base
            module.__class__ = cls

    def _restore_class(self, module: nn.Module) -> None:
        if (cls := self._swapped.pop(module, None)) is not None:
            module.__class__ = cls

    def is_prepared(self, module: nn.Module) -> bool:
        """Whether ``module`` currently carries the class it gave it."""
        return module in self._swapped

    def _attach(self, model: nn.Module) -> None:
        """Override for per-instance work."""

    def _detach(self, model: nn.Module) -> None:
        """Override for per-instance work."""

    def __repr__(self) -> str:
        return f"<Optimization {self.name} ({self.tier()}, installed={self._installed})>"
