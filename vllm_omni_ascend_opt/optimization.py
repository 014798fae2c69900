"""The :class:`Optimization` base: metadata, switches, and the one answer to "does it act here, and why not".

Each swappable change subclasses :class:`Optimization` (``opts/``) and has two levels of switches:

* ``install()`` / ``uninstall()``: process-wide patches of upstream classes and module globals, made before any
  model is built (the plugin installs an optimization once the modules named in ``target_modules`` are imported).
* ``attach(model)`` / ``detach(model)``: per-instance work on a built pipeline or transformer (weight casts, swapped
  attention implementations, VAE submodules).

Both levels are idempotent and restore the originals by identity (:mod:`vllm_omni_ascend_opt._patching`).

One method answers whether it acts and why not: :meth:`Optimization.reasons_inactive`, for the process (no model)
or for a given model. It combines, in this order, the upstream code it declares (:attr:`Optimization.upstream`:
functions whose source differs from every fingerprint it knows, :mod:`.blocks.upstream`), the environment
(:meth:`Optimization._process_reasons`: missing kernels, bad settings), the optimizations it ``needs``; for a model
first whether it is vLLM-Omni's Qwen-Image-2.1 (:attr:`Optimization.on_qwen_image_21`), then whether it is installed
and attached, the reusable model checks it declares (:attr:`Optimization.model_checks`: compiled regions, parallel modes, ...) and
its own model facts (:meth:`Optimization._model_reasons`: offload, dtype, hooks, kernel verdicts). Everything that
reports (``list``, ``status()``, the INFO line, the status file, the ablation worker, the parallel test jobs) asks it.

Each optimization also owns its statistics (:attr:`Optimization.stats`), its fallback reasons (why calls ran stock
code, :meth:`Optimization.fallback_reasons`) and the memory its caches hold (:meth:`Optimization.cache_memory`).
Bookkeeping never happens inside a traced forward: patched code checks :func:`blocks.upstream.guards.tracing` first.
"""

from __future__ import annotations

import logging
import sys
import weakref
from collections import Counter
from typing import Any, ClassVar, Literal, Protocol

import torch.nn as nn

from vllm_omni_ascend_opt._parallel import parallel_reasons_inactive
from vllm_omni_ascend_opt._patching import PatchSet
from vllm_omni_ascend_opt.blocks.upstream import fingerprints as _upstream
from vllm_omni_ascend_opt.blocks.upstream import guards
from vllm_omni_ascend_opt.blocks.upstream.fingerprints import Upstream

logger = logging.getLogger("vllm_omni_ascend_opt")

Equivalence = Literal["exact", "pixel", "close"]
#: Equivalence tiers, strongest first. ``exact``: bitwise-identical outputs; ``pixel``: the uint8 images are identical
#: (float outputs may differ in the last bits); ``close``: the images pass the SSIM/PSNR gates.
TIERS: tuple[str, ...] = ("exact", "pixel", "close")

#: Parallel modes an optimization declares its support for (vLLM-Omni's names, see ``_parallel.active_modes``).
PARALLEL_MODES = ("single", "ulysses", "ring", "cfg_parallel", "tensor_parallel", "allgather", "vae_patch_parallel")

#: The stages of one request, in order (the ablation runner times each): prompt encoding, the denoising loop, the
#: latents' unpacking and VAE decode.
STAGES: tuple[str, ...] = ("text_encode", "denoise", "vae_decode")
#: The stage whose time code in each region can change. ``load`` work (weight casts) is done once, but changes what
#: every transformer forward reads, so denoise.
STAGE_OF_REGION = {"block": "denoise", "transformer": "denoise", "load": "denoise", "vae": "vae_decode"}


def weakest_tier(tiers: list[str] | tuple[str, ...] | set[str]) -> str:
    """The weakest of ``tiers`` (``exact`` for none): what a configuration containing them can promise."""
    return max(tiers, key=TIERS.index, default="exact")


class ModelCheck(Protocol):
    """A reusable model-level check: ``check(opt, model)`` -> the reason ``opt`` does not act on ``model``, or None."""

    def __call__(self, opt: Optimization, model: Any) -> str | None: ...


class Peers(Protocol):
    """What an optimization may ask of the others (the registry provides it; optimizations never import each
    other): look one up by name, and announce that weights changed."""

    def get(self, name: str) -> Optimization: ...

    def weights_changed(self, model: Any = None, *, source: Optimization | None = None) -> None: ...


class Optimization:
    """Base class. Subclasses set the class attributes and override the hooks they need."""

    name: ClassVar[str]
    #: What it does, in a line. This and :attr:`why`, :attr:`how`, :attr:`upstream_pr` and :attr:`removal_plan` are
    #: the one text about it: ``list``, the README table and the header of its patch (tools/gen_docs.py) show them.
    summary: ClassVar[str]
    #: The stock work it removes and why that matters ("" renders nothing).
    why: ClassVar[str] = ""
    #: How it does it, and why that keeps its :attr:`equivalence`.
    how: ClassVar[str] = ""
    #: Open upstream PRs that touch the same code and how they differ, or what to propose upstream.
    upstream_pr: ClassVar[str] = ""
    #: The weakest tier this optimization can deliver anywhere (its class); :meth:`tier` says what it delivers here.
    equivalence: ClassVar[Equivalence]
    default_enabled: ClassVar[bool] = True
    #: Human-readable requirements, shown by ``list``.
    requires: ClassVar[tuple[str, ...]] = ()
    #: When it stays off or runs stock code, in a sentence (the README's table; ``reasons_inactive`` says it per case).
    inactive_when: ClassVar[str] = ""
    #: Modules whose import triggers ``install`` (all must be fully imported first).
    target_modules: ClassVar[tuple[str, ...]] = ()
    #: Per parallel mode: "supported", or "off: <reason>" when the optimization does not act there (a mode it does
    #: not mention is not supported). Checked for every model (``_parallel.parallel_reasons_inactive``).
    parallel_support: ClassVar[dict[str, str]] = dict.fromkeys(PARALLEL_MODES, "supported")
    #: Where the patched code runs: ``block`` (inside the transformer blocks), ``transformer`` (its forward outside
    #: them), ``vae`` (the decode) or ``load`` (once, on the weights). A compiled region of the model runs stock
    #: code for the optimizations that live in it (they step aside while torch.compile traces).
    regions: ClassVar[frozenset[str]] = frozenset()
    #: The request stages (:data:`STAGES`) whose time it can change; None: those of its :attr:`regions`
    #: (:data:`STAGE_OF_REGION`), every stage when it declares no region. :meth:`changed_stages` is the answer.
    stages: ClassVar[frozenset[str] | None] = None
    #: The compile granularities (``"regional"``: vLLM-Omni's repeated blocks; ``"full"``: the whole transformer)
    #: under which its code acts inside the compiled graphs (written for tracing; value-keyed work done outside them).
    #: Under any other compile of all its :attr:`regions` it steps aside while dynamo traces: a reason on that model.
    acts_compiled: ClassVar[frozenset[str]] = frozenset()
    #: Its process-wide patches act on every model (nothing per instance): no ``attach`` needed to act.
    acts_without_attach: ClassVar[bool] = False
    #: Further reusable model-level checks asked by :meth:`reasons_inactive` for a model, in order.
    model_checks: ClassVar[tuple[ModelCheck, ...]] = ()
    #: The upstream change that makes this optimization obsolete.
    removal_plan: ClassVar[str] = ""
    #: ``(SSIM, PSNR dB)`` this optimization must meet against the configuration without it when it delivers the
    #: ``close`` tier (the ablation runner's gate); None: the workload's ``ssim_gate`` / ``psnr_gate``.
    close_gates: ClassVar[tuple[float, float] | None] = None
    #: Optimizations this one acts through (it does nothing without them): inactive with their reasons when they
    #: are, and the ablation planner keeps them in every configuration that has this one.
    needs: ClassVar[tuple[str, ...]] = ()
    #: ``OmniDiffusionConfig`` fields (name -> value) without which it has nothing to act on (e.g.
    #: ``enable_layerwise_offload``): the ablation planner leaves it out of workloads that do not set them.
    needs_config: ClassVar[dict[str, Any]] = {}
    #: Why it has no maintainers' patch in ``patches/`` (empty: it has one; tests/test_patches.py checks both).
    no_patch_reason: ClassVar[str] = ""
    #: The upstream functions it patches, replaces or mirrors, with the source fingerprints it knows per vLLM-Omni
    #: release (:mod:`vllm_omni_ascend_opt.blocks.upstream.fingerprints`): it installs where each matches a known fingerprint,
    #: and stays off with the function and the versions it knows where one differs (unless forced).
    upstream: ClassVar[tuple[Upstream, ...]] = ()
    #: Why it stays off on vLLM-Omni's Qwen-Image-2.1 (what upstream already does there); "" when it handles 2.1
    #: itself. Checked before anything else for a model (:func:`~vllm_omni_ascend_opt.blocks.upstream.fingerprints.qwen_image_21`).
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

    # ----- the one answer: does it act, and why not -------------------------------------------------------------
    def reasons_inactive(self, model: Any = None) -> list[str]:
        """Why this optimization does not act (empty list: it does), in words.

        Without ``model``: in this process (environment only: missing kernels or torch_npu, upstream code it does
        not recognise, invalid settings, the optimizations it needs). With ``model`` (a pipeline or a transformer):
        on that model, which adds whether it is installed and attached, the parallel modes it does not support
        (:attr:`parallel_support`), the compiled regions it lives in (:attr:`regions`), the declared
        :attr:`model_checks` and the optimization's own facts (offload, dtype, hooks, kernel verdicts).
        """
        reasons = self.upstream_reasons() + list(self._process_reasons()) + self._needs_reasons(None)
        if model is None:
            return list(dict.fromkeys(reasons))
        why_21 = self.qwen_image_21_reason(model)
        if why_21:
            return list(dict.fromkeys([why_21, *reasons]))
        attached = self.is_attached(model)
        if not self._installed and not attached:
            return list(dict.fromkeys(reasons)) or ["not installed"]
        if not attached and not self.acts_without_attach:
            reasons.append("not attached to this model")
        else:
            reasons += self._needs_reasons(model)
            reasons += parallel_reasons_inactive(self, model)
            why = guards.compile_reason(self.regions, model, self.name, self.acts_compiled)
            if why:
                reasons.append(why)
            for check in self.model_checks:
                why = check(self, model)
                if why:
                    reasons.append(why)
            reasons += self._model_reasons(model)
        return list(dict.fromkeys(reasons))

    @classmethod
    def changed_stages(cls) -> tuple[str, ...]:
        """The stages whose time this optimization can change, in :data:`STAGES` order. The ablation runner takes
        its saving and verdict on these and uses the others as a control (docs/ablation.md, "How verdicts are
        made")."""
        own = cls.stages if cls.stages is not None else {STAGE_OF_REGION[r] for r in cls.regions}
        return tuple(st for st in STAGES if st in own) if own else STAGES

    def acting(self, model: Any = None) -> bool:
        """``not reasons_inactive(model)``: with a model, it acts through its per-instance work (attached) or through
        process-wide patches that reach every model (installed and :attr:`acts_without_attach`)."""
        return not self.reasons_inactive(model)

    def _process_reasons(self) -> list[str]:
        """Override: environment-level reasons (missing torch_npu or kernels, bad settings). Unknown upstream code is
        declared (:attr:`upstream`), not checked here."""
        return []

    def upstream_reasons(self) -> list[str]:
        """Why the upstream code differs from what it knows (:attr:`upstream`); empty under
        ``VLLM_OMNI_ASCEND_OPT_FORCE`` (then :meth:`upstream_notes` says it)."""
        if not self.upstream or _upstream.forced():
            return []
        return _upstream.reasons(self.upstream, self.name)

    def upstream_findings(self) -> list[_upstream.Finding]:
        """What each declared upstream function is here (fingerprint, the releases it matches, checked or not)."""
        return _upstream.check(self.upstream)

    def upstream_notes(self) -> list[str]:
        """For ``list``: how its upstream code matched, and under ``FORCE`` what it acts despite."""
        findings = self.upstream_findings()
        if not findings:
            return []
        out = [_upstream.summary(findings)]
        if _upstream.forced():
            out += [f"{_upstream.ENV_FORCE}=1: acts although {f.reason(self.name)}" for f in findings if not f.ok]
        return out

    def qwen_image_21_reason(self, model: Any) -> str | None:
        """Why it stays off on ``model`` when that is vLLM-Omni's Qwen-Image-2.1 (None otherwise, or when it
        handles 2.1 itself: :attr:`on_qwen_image_21` empty)."""
        if not self.on_qwen_image_21:
            return None
        cls = _upstream.qwen_image_21(model)
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

    def model_notes(self, model: Any) -> list[str]:
        """Facts about how it acts on ``model`` when it acts only in part (e.g. some blocks keep stock code)."""
        return []

    def tier(self) -> Equivalence:
        """The equivalence tier this optimization delivers in this process (``list``, ``status()``, the ablation
        gates). Default: its class, :attr:`equivalence`; optimizations whose paths differ per backend override it
        (``rope``: ``exact`` on the portable path, ``pixel`` with the NPU kernel)."""
        return self.equivalence

    # ----- what it ran, what it holds ---------------------------------------------------------------------------
    def fallback_reasons(self) -> dict[str, int]:
        """Why calls ran stock code since the last :meth:`reset_stats` (reason -> number of calls)."""
        return dict(self._fallbacks)

    def reset_stats(self) -> None:
        """Clear :attr:`stats` and the fallback reasons."""
        self.stats.clear()
        self._fallbacks.clear()

    def kernel_classes(self) -> dict[str, Any] | None:
        """For an optimization that runs a verified device kernel: how many shape classes use it, how many run
        stock, and why (``blocks.kernels.verified.KernelPath.tally``); None for the others. Off is reserved for off everywhere."""
        return None

    def cache_memory(self) -> dict[str, Any] | None:
        """Memory its caches hold, with their budgets (``{"bytes": ..., ...}``); None when it keeps none."""
        return None

    def _fallback(self, why: str) -> None:
        """Count a call that ran stock code and log each distinct reason once (debug).

        Never call this while torch.compile traces: patched code checks ``guards.tracing()`` before any bookkeeping.
        """
        self._fallbacks[why] += 1
        if why not in self._logged:
            self._logged.add(why)
            logger.debug("vllm-omni-ascend-opt: %s runs stock code: %s", self.name, why)

    # ----- events -----------------------------------------------------------------------------------------------
    def bind_peers(self, peers: Peers) -> None:
        """Called by the registry when this optimization joins it."""
        self._peers = peers

    def weights_changed(self, model: Any = None) -> None:
        """Hook: weights of ``model`` (None: of any model) changed in a way version counters cannot see (a
        ``w.data = ...`` swap). Optimizations that key caches on weights drop them here."""

    def announce_weights_changed(self, model: Any = None) -> None:
        """Tell every other registered optimization that this one changed weights of ``model``."""
        if self._peers is not None:
            self._peers.weights_changed(model, source=self)

    # ----- process-wide patches ---------------------------------------------------------------------------------
    @property
    def installed(self) -> bool:
        return self._installed

    def targets_imported(self) -> bool:
        return all(fully_imported(m) for m in self.target_modules)

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
        self.patches.revert()
        self._uninstall()
        self.reset_stats()
        self._logged.clear()
        self._installed = False

    def _install(self) -> None:
        """Override: make the process-wide patches through ``self.patches``."""

    def _uninstall(self) -> None:
        """Override: drop state kept outside ``self.patches`` (caches)."""

    # ----- per-instance work ------------------------------------------------------------------------------------
    def attach(self, model: nn.Module) -> None:
        """Apply per-instance work to a built pipeline or transformer. Idempotent. Nothing on a model it stays off
        for (:meth:`qwen_image_21_reason`): upstream already does that work there."""
        if model in self._attached or self.qwen_image_21_reason(model):
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


def fully_imported(module_name: str) -> bool:
    """``module_name`` is in ``sys.modules`` and has finished executing."""
    mod = sys.modules.get(module_name)
    if mod is None:
        return False
    spec = getattr(mod, "__spec__", None)
    return not getattr(spec, "_initializing", False)
