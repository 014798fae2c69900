"""Shared machinery of ``vae_exact`` and ``vae_fast``: find the VAE, patch it per instance, report what acts.

The text-to-image pipeline decodes with vLLM-Omni's ``DistributedAutoencoderKLQwenImage``, a subclass of diffusers'
``AutoencoderKLQwenImage`` that does not override ``_decode`` or any decoder submodule. Both VAE optimizations work
per *instance* (never on the classes, which other pipelines and the encoder share) and only through attributes of
the instances' own ``__dict__`` (``vae._decode``, ``vae.clear_cache``, ``submodule.forward``,
``pipeline._decode_latents``), recorded in one :class:`~vllm_omni_ascend_opt._patching.PatchSet` per attached model,
so that ``detach`` restores the class attribute by identity. ``vae.decode`` itself is never touched: vLLM-Omni's
pipeline profiler wraps it per instance.

The two optimizations patch disjoint attributes (``vae_exact``: ``_decode``, ``tiled_decode``, ``tile_exec``,
``clear_cache``, upsample and 1x1x1 convolution forwards, ``_decode_latents``; ``vae_fast``: 3x3x3 / 3x1x1 causal
convolution and RMS-norm forwards), so they compose in any attach/detach order.

Every patched function asks :func:`vllm_omni_ascend_opt.blocks.upstream.guards.tracing` first and, while torch.compile
traces, runs the stock code without bookkeeping (no fallback counted, no verdict read, no cache built or read).
vLLM-Omni does not compile the VAE; the rule is the same as in the transformer so that a compiled decode holds stock
code. Fallbacks outside tracing go through the base's ``_fallback``.
"""

from __future__ import annotations

import importlib
import logging
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from types import MethodType, ModuleType
from typing import Any

import torch.nn as nn

from vllm_omni_ascend_opt._patching import PatchSet
from vllm_omni_ascend_opt.blocks.upstream import targets as _targets
from vllm_omni_ascend_opt.optimization import Optimization

logger = logging.getLogger("vllm_omni_ascend_opt")

#: piece name -> "" (acts) or the reason it does not.
PieceReport = dict[str, str]


def diffusers_vae() -> ModuleType:
    """diffusers' ``autoencoder_kl_qwenimage`` module (imported by vLLM-Omni's distributed VAE anyway)."""
    return importlib.import_module(_targets.DIFFUSERS_VAE)


def decode_modules(vae: nn.Module) -> Iterator[nn.Module]:
    """Every module that runs during ``vae._decode``: ``post_quant_conv`` and the decoder's modules."""
    yield from vae.post_quant_conv.modules()
    yield from vae.decoder.modules()


def of_exact_class(module: nn.Module, cls: type, method: str = "forward") -> bool:
    """``module`` is a ``cls`` whose ``method`` is ``cls``'s own (not overridden by a subclass or an instance)."""
    return (
        isinstance(module, cls)
        and getattr(type(module), method, None) is getattr(cls, method)
        and method not in module.__dict__
    )


def resolve(model: Any) -> tuple[Any | None, nn.Module | None, list[str]]:
    """``(pipeline or None, vae or None, reasons)`` for ``model``: a pipeline with ``.vae`` or a bare VAE.

    ``reasons`` is empty when the VAE is diffusers' ``AutoencoderKLQwenImage`` (or vLLM-Omni's distributed
    subclass) with the stock ``_decode`` and decoder; otherwise it says why the VAE optimizations leave it alone.
    """
    mod = diffusers_vae()
    base = mod.AutoencoderKLQwenImage
    if isinstance(model, base):
        pipe, vae = None, model
    else:
        vae = getattr(model, "vae", None)
        if vae is None:
            return None, None, [f"{type(model).__name__} is neither a Qwen-Image VAE nor a pipeline with a .vae"]
        pipe = model
        if not isinstance(vae, base):
            return (
                pipe,
                None,
                [
                    f"{type(model).__name__}.vae is {type(vae).__module__}.{type(vae).__name__}, not diffusers' "
                    "AutoencoderKLQwenImage (vLLM-Omni's DistributedAutoencoderKLQwenImage is the supported one)"
                ],
            )
    reasons = []
    if getattr(type(vae), "_decode", None) is not base._decode:
        reasons.append(f"{type(vae).__name__} overrides _decode")
    if type(getattr(vae, "decoder", None)) is not mod.QwenImageDecoder3d:
        reasons.append("its decoder is not diffusers' QwenImageDecoder3d")
    if not isinstance(getattr(vae, "post_quant_conv", None), mod.QwenImageCausalConv3d):
        reasons.append("its post_quant_conv is not a QwenImageCausalConv3d")
    return pipe, (None if reasons else vae), reasons


@dataclass
class _Attached:
    patches: PatchSet
    vae: nn.Module | None
    pieces: PieceReport = field(default_factory=dict)
    reasons: list[str] = field(default_factory=list)


class VaeOptimization(Optimization):
    """Per-instance VAE optimization: subclasses implement :meth:`_patch_pieces` and list :attr:`pieces`."""

    #: The pieces this optimization is made of, in the order they are reported.
    pieces: tuple[str, ...] = ()

    def __init__(self) -> None:
        super().__init__()
        #: Pieces attached by the next ``attach`` (benchmarks switch single pieces off to measure them).
        self.enabled_pieces: set[str] = set(self.pieces)
        self._state: weakref.WeakKeyDictionary[Any, _Attached] = weakref.WeakKeyDictionary()
        self._vae_owner: weakref.WeakKeyDictionary[nn.Module, Any] = weakref.WeakKeyDictionary()

    # ----- subclass hooks ----------------------------------------------------------------------------------
    def _patch_pieces(self, pipe: Any | None, vae: nn.Module, ps: PatchSet) -> PieceReport:
        """Install this optimization's pieces on ``vae`` (and ``pipe``) through ``ps``; report each piece."""
        raise NotImplementedError

    # ----- bookkeeping -------------------------------------------------------------------------------------
    def wants(self, piece: str) -> str:
        """ "" when ``piece`` should be attached, else why not (switched off through ``enabled_pieces``)."""
        return "" if piece in self.enabled_pieces else "switched off (enabled_pieces)"

    def patch_forwards(self, piece: str, modules: list[nn.Module], make_forward: Any, ps: PatchSet, none: str) -> str:
        """Replace ``forward`` of each module in ``modules`` by ``make_forward(module)`` (through ``ps``) when
        ``piece`` is wanted and there is at least one; returns "" when it acts, else why not (``none`` if empty)."""
        why = self.wants(piece) or ("" if modules else none)
        for m in modules if not why else ():
            ps.set(m, "forward", bind(m, make_forward(m)))
        return why

    def piece_report(self, model: Any) -> PieceReport:
        """For an attached ``model``: piece -> "" when it acts, else the reason it does not."""
        st = self._state.get(model)
        if st is None:
            return {p: "not attached" for p in self.pieces}
        return dict(st.pieces)

    def _model_reasons(self, model: Any) -> list[str]:
        st = self._state.get(model)
        if st is not None:
            if st.reasons:
                return list(st.reasons)
            if not any(v == "" for v in st.pieces.values()):
                return [f"{p}: {why}" for p, why in st.pieces.items()]
            return []
        _pipe, vae, reasons = resolve(model)
        if not reasons and vae in self._vae_owner:
            return ["its VAE is already attached through another model"]
        return reasons

    # ----- attach / detach ---------------------------------------------------------------------------------
    def _attach(self, model: Any) -> None:
        ps = PatchSet(f"{self.name}:{type(model).__name__}")
        pipe, vae, reasons = resolve(model)
        if not reasons and vae in self._vae_owner:
            reasons = ["its VAE is already attached through another model"]
        st = _Attached(ps, None, reasons=reasons)
        if reasons:
            logger.info("vllm-omni-ascend-opt: %s does nothing for %s: %s", self.name, type(model).__name__, reasons)
        else:
            try:
                st.pieces = self._patch_pieces(pipe, vae, ps)
            except Exception:
                ps.revert()
                raise
            st.vae = vae
            self._vae_owner[vae] = model
            off = {p: why for p, why in st.pieces.items() if why}
            if off:
                logger.info("vllm-omni-ascend-opt: %s pieces off for %s: %s", self.name, type(model).__name__, off)
        self._state[model] = st

    def _detach(self, model: Any) -> None:
        st = self._state.pop(model, None)
        if st is None:
            return
        st.patches.revert()
        if st.vae is not None:
            self._vae_owner.pop(st.vae, None)


def bind(module: Any, fn: Any) -> MethodType:
    """``fn`` bound to ``module`` (stored in the instance ``__dict__``, it shadows the class method)."""
    return MethodType(fn, module)
