"""Shared machinery of ``vae_exact`` and ``vae_fast``: find the VAE, patch it per instance, report what acts.

Both patch only instance attributes (never the classes, which the encoder shares), recorded in one ``PatchSet`` per
attached model so that ``detach`` restores them; ``vae.decode`` itself is never touched (vLLM-Omni's profiler wraps
it). The two patch disjoint attributes, so they compose in any order. While dynamo traces, stock code runs.
"""

from __future__ import annotations

import importlib
import logging
import weakref
from dataclasses import dataclass, field
from types import MethodType, ModuleType
from typing import Any

import torch.nn as nn

from vllm_omni_ascend_opt._patching import PatchSet
from vllm_omni_ascend_opt.blocks.upstream import targets as _targets
from vllm_omni_ascend_opt.optimization import Optimization

logger = logging.getLogger("vllm_omni_ascend_opt")


def diffusers_vae() -> ModuleType:
    """diffusers' ``autoencoder_kl_qwenimage`` module (imported by vLLM-Omni's distributed VAE anyway)."""
    return importlib.import_module(_targets.DIFFUSERS_VAE)


def of_exact_class(module: nn.Module, cls: type) -> bool:
    """``module`` is a ``cls`` whose ``forward`` is ``cls``'s own (not overridden by a subclass or an instance)."""
    return isinstance(module, cls) and type(module).forward is cls.forward and "forward" not in module.__dict__


@dataclass
class _Attached:
    patches: PatchSet
    vae: nn.Module | None
    pieces: dict[str, str] = field(default_factory=dict)
    reasons: list[str] = field(default_factory=list)


class VaeOptimization(Optimization):
    """Per-instance VAE optimization: subclasses implement :meth:`_patch_pieces` and list :attr:`pieces`."""

    requires = ("diffusers' AutoencoderKLQwenImage (vLLM-Omni's distributed subclass); any device",)
    target_modules = (_targets.DIST_VAE,)
    regions = frozenset({"vae"})
    #: The pieces this optimization is made of, in the order they are reported.
    pieces: tuple[str, ...] = ()

    def __init__(self) -> None:
        super().__init__()
        #: Pieces attached by the next ``attach`` (benchmarks switch single pieces off).
        self.enabled_pieces: set[str] = set(self.pieces)
        self._state: weakref.WeakKeyDictionary[Any, _Attached] = weakref.WeakKeyDictionary()
        self._vae_owner: weakref.WeakKeyDictionary[nn.Module, Any] = weakref.WeakKeyDictionary()

    def _patch_pieces(self, pipe: Any | None, vae: nn.Module, ps: PatchSet) -> dict[str, str]:
        """Install this optimization's pieces on ``vae`` (and ``pipe``) through ``ps``; report each piece."""
        raise NotImplementedError

    def wants(self, piece: str) -> str:
        """ "" when ``piece`` should be attached, else why not (switched off through ``enabled_pieces``)."""
        return "" if piece in self.enabled_pieces else "switched off (enabled_pieces)"

    def patch_forwards(self, piece: str, vae: nn.Module, eligible: Any, make: Any, ps: PatchSet, none: str) -> str:
        """The ``forward`` of each ``eligible`` module that runs during ``vae._decode`` (``post_quant_conv`` and the
        decoder's) replaced by ``make(module)``; "" when it acts, else why not."""
        modules = [m for part in (vae.post_quant_conv, vae.decoder) for m in part.modules() if eligible(m)]
        why = self.wants(piece) or ("" if modules else none)
        for m in modules if not why else ():
            ps.set(m, "forward", MethodType(make(m), m))
        return why

    def piece_report(self, model: Any) -> dict[str, str]:
        """For an attached ``model``: piece -> "" when it acts, else the reason it does not."""
        st = self._state.get(model)
        return dict(st.pieces) if st is not None else {p: "not attached" for p in self.pieces}

    def _model_reasons(self, model: Any) -> list[str]:
        if (st := self._state.get(model)) is None:
            return self._resolve(model)[2]
        if st.reasons or "" in st.pieces.values():
            return list(st.reasons)
        return [f"{p}: {why}" for p, why in st.pieces.items()]

    def _resolve(self, model: Any) -> tuple[Any | None, nn.Module | None, list[str]]:
        """``(pipeline or None, vae or None, reasons)`` for a pipeline with ``.vae`` or a bare VAE; ``reasons``: why
        this optimization leaves it alone."""
        mod = diffusers_vae()
        base = mod.AutoencoderKLQwenImage
        pipe, vae = (None, model) if isinstance(model, base) else (model, getattr(model, "vae", None))
        if vae is None:
            return None, None, [f"{type(model).__name__} is neither a Qwen-Image VAE nor a pipeline with a .vae"]
        if not isinstance(vae, base):
            why = (
                f"{type(model).__name__}.vae is {type(vae).__module__}.{type(vae).__name__}, not diffusers' "
                "AutoencoderKLQwenImage (vLLM-Omni's DistributedAutoencoderKLQwenImage is the supported one)"
            )
            return pipe, None, [why]
        reasons = []
        if getattr(type(vae), "_decode", None) is not base._decode:
            reasons.append(f"{type(vae).__name__} overrides _decode")
        if type(getattr(vae, "decoder", None)) is not mod.QwenImageDecoder3d:
            reasons.append("its decoder is not diffusers' QwenImageDecoder3d")
        if not isinstance(getattr(vae, "post_quant_conv", None), mod.QwenImageCausalConv3d):
            reasons.append("its post_quant_conv is not a QwenImageCausalConv3d")
        if not reasons and vae in self._vae_owner:
            reasons.append("its VAE is already attached through another model")
        return pipe, (None if reasons else vae), reasons

    def _attach(self, model: Any) -> None:
        pipe, vae, reasons = self._resolve(model)
        st = _Attached(PatchSet(f"{self.name}:{type(model).__name__}"), None, reasons=reasons)
        if reasons:
            logger.info("vllm-omni-ascend-opt: %s does nothing for %s: %s", self.name, type(model).__name__, reasons)
        else:
            try:
                st.pieces = self._patch_pieces(pipe, vae, st.patches)
            except Exception:
                st.patches.revert()
                raise
            st.vae = vae
            self._vae_owner[vae] = model
            if off := {p: why for p, why in st.pieces.items() if why}:
                logger.info("vllm-omni-ascend-opt: %s pieces off for %s: %s", self.name, type(model).__name__, off)
        self._state[model] = st

    def _detach(self, model: Any) -> None:
        st = self._state.pop(model)  # set by every _attach that returned
        st.patches.revert()
        if st.vae is not None:
            self._vae_owner.pop(st.vae, None)
