"""`nz_weights`: the transformer's BF16/FP16 linear weights cast to FRACTAL_NZ after loading (:class:`NzWeights`).

``attach`` runs from the plugin's wrapper of ``DiffusersPipelineLoader.load_model`` (before CPU offload) and sets
``w.data = npu_format_cast(w.data, 29)`` per eligible weight, all or nothing; ``detach`` casts back to ND. Either
announces a weights-changed event (``w.data = ...`` changes neither identity nor ``_version``). Under vLLM-Omni's NPU
int8 (``--quantization int8``) the int8 ``[k, n]`` weights are cast too where ``npu_quant_matmul`` gives the ND
result bit for bit at that weight shape (int32 accumulation) and, timed as vLLM-Omni calls it, beats ND; a refused
shape stays ND, with its reason. Every weight shape is timed, NZ against ND, and kept only where faster.
"""

from __future__ import annotations

import logging
import sys
import weakref
from collections import Counter
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import torch
import torch.nn as nn

from vllm_omni_ascend_opt import _backend
from vllm_omni_ascend_opt.blocks.kernels.nz_check import (
    ACL_FORMAT_FRACTAL_NZ,
    ACL_FORMAT_ND,
    NzInt8Path,
    NzPath,
    is_npu_int8,
    trial_cast,
    version_reasons,
)
from vllm_omni_ascend_opt.blocks.kernels.verdicts import Verdict
from vllm_omni_ascend_opt.blocks.upstream import targets as _targets
from vllm_omni_ascend_opt.optimization import Optimization

logger = logging.getLogger("vllm_omni_ascend_opt")

# Per-layer skip reasons (keys of report(model)["skipped"]).
SKIP_QUANTIZED = "quantized"
SKIP_LORA = "runtime LoRA layer"
SKIP_OFFLOAD_HOOK = "under a layerwise offload hook"
SKIP_DTENSOR = "DTensor (HSDP/FSDP2)"
SKIP_NOT_NPU = "not on the NPU"
SKIP_NOT_2D = "not 2-D"
SKIP_NARROW = "n == 1 or k == 1"
SKIP_CAST_FAILED = "cast did not produce FRACTAL_NZ"
SKIP_SLOWER = "NZ GEMM not faster than ND at production rows"


@dataclass
class _State:
    npu: ModuleType | None
    cast: list[tuple[str, nn.Parameter]] = field(default_factory=list)
    skipped: Counter = field(default_factory=Counter)
    reasons: list[str] = field(default_factory=list)
    int8: dict[str, str] = field(default_factory=dict)  # vLLM-Omni NPU int8 layer -> FRACTAL_NZ or why not


def _config_reasons(model: nn.Module) -> list[str]:
    """Why the configuration of ``model`` rules the cast out: CPU offload of the DiT, runtime LoRA, HSDP."""
    cfg = getattr(model, "od_config", None)
    if cfg is None:
        try:
            from vllm_omni.diffusion.config import get_current_diffusion_config_or_none

            cfg = get_current_diffusion_config_or_none()
        except Exception:
            return []
    if cfg is None:
        return []
    reasons = []
    try:
        from vllm_omni.diffusion.offloader.config import DIT_COMPONENT, OffloadStrategy, resolve_offload

        resolved = resolve_offload(cfg)
    except Exception:
        resolved = None
    if resolved is not None and resolved.strategy is not OffloadStrategy.NONE and resolved.offloads(DIT_COMPONENT):
        reasons.append(
            f"CPU offload of the DiT is configured ({resolved.strategy.value}): the offloader moves and copies the "
            "weights after loading, which an internal-format weight does not survive"
        )
    backend = getattr(cfg, "lora_backend", "peft")
    runtime_lora = getattr(cfg, "lora_path", None) and not getattr(model, "lora_is_fused", False)
    if runtime_lora and str(getattr(backend, "value", backend)) != "distill":
        reasons.append("runtime LoRA is configured (lora_path with the PEFT backend): adapters are swapped per request")
    if getattr(getattr(cfg, "parallel_config", None), "use_hsdp", False):
        reasons.append("HSDP is on: the weights are DTensor shards gathered per forward")
    return reasons


def _lora_and_offload_prefixes(transformer: nn.Module, lora_types: tuple[type, ...]) -> tuple[list[str], list[str]]:
    """Names of LoRA wrappers (``BaseLayerWithLoRA`` or with a ``base_layer``) and of modules under an offload hook."""
    lora, offloaded = [], []
    for name, m in transformer.named_modules():
        if (lora_types and isinstance(m, lora_types)) or isinstance(getattr(m, "base_layer", None), nn.Module):
            lora.append(name)
        if any("offload" in str(h) for h in getattr(getattr(m, "_hook_registry", None), "_hooks", None) or {}):
            offloaded.append(name)
    return lora, offloaded


def _under(name: str, prefixes: list[str]) -> bool:
    return any(not p or name == p or name.startswith(p + ".") for p in prefixes)


def _is_dtensor(t: torch.Tensor) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without distributed
        return False
    return isinstance(t, DTensor) or isinstance(getattr(t, "data", None), DTensor)


class NzWeights(Optimization):
    name = "nz_weights"
    summary = "Cast the transformer's BF16/FP16 linear weights to FRACTAL_NZ (npu_format_cast(w, 29)) after loading."
    why = "Ascend's Cube unit reads matmul weights in FRACTAL_NZ; an ND weight is re-laid-out on every GEMM."
    how = (
        "After loading, w.data = npu_format_cast(w.data, 29) for each eligible unquantized BF16/FP16 linear "
        "weight (CANN >= 8.3, permitted by a trial cast, numbers checked per (device, dtype)) and each int8 weight "
        "of vLLM-Omni's NPU int8 linears (npu_quant_matmul bitwise against ND per weight shape), all or nothing."
    )
    upstream_pr = "Qwen-Image (1.x): none (vllm-ascend's weight_nz_mode=2 is the LLM-side equivalent)."
    equivalence = "close"
    requires = (
        "torch_npu >= 2.8 with CANN >= 8.3 (WeightNz matmul routing); weights on an NPU; fp16/bf16; internal formats "
        "allowed (checked by a trial cast)",
    )
    target_modules = (_targets.TRANSFORMER,)
    regions = frozenset({"load"})
    removal_plan = "Drop when vLLM-Omni's NPU loader casts unquantized DiT linear weights to NZ itself."
    upstream = (_targets.LOAD_MODEL,)  # its attach point
    on_qwen_image_21 = "upstream casts its bf16 linear weights to FRACTAL_NZ itself; nz_weights never casts there"

    def __init__(self) -> None:
        super().__init__()
        self._models: weakref.WeakKeyDictionary[nn.Module, _State] = weakref.WeakKeyDictionary()
        #: The numbers per (device, dtype), and the guard the cast runs under.
        self.path = NzPath(self.name, self.stats)
        #: int8 weights of vLLM-Omni's NPU int8 linears: bitwise per weight shape; a refusal skips that shape only.
        self.int8 = NzInt8Path(self.name, self.stats)

    def _process_reasons(self) -> list[str]:
        reasons = _backend.npu_unavailable_reasons()
        if (npu := _backend.torch_npu_module()) is not None:
            if missing := [f for f in ("npu_format_cast", "get_npu_format") if not hasattr(npu, f)]:
                reasons.append(f"{_backend.backend_label()} has no {', '.join(missing)}")
            reasons += version_reasons(npu)
            reasons += [v.describe() for v in self.path.firsts.values() if not v.ok]
        return reasons

    def verdicts(self) -> list[Verdict]:
        """The first-use numerical checks so far, one per (device, dtype) and one per int8 weight shape."""
        return [*self.path.firsts.values(), *self.int8.firsts.values()]

    def _model_reasons(self, model: nn.Module) -> list[str]:
        state = self._models[model]  # asked only while attached
        reasons = list(state.reasons)
        if not state.cast and not reasons:
            skipped = ", ".join(f"{k}: {n}" for k, n in state.skipped.items()) or "no linear layer found"
            reasons.append(f"no linear weight was cast to FRACTAL_NZ (skipped: {skipped})")
        return reasons

    def notes(self) -> list[str]:
        out = [
            f"w.data = npu_format_cast(w.data, {ACL_FORMAT_FRACTAL_NZ}) on the transformer's fp16/bf16 linear weights "
            f"after loading; reverted to ND ({ACL_FORMAT_ND}) on detach; announces a weights-changed event "
            "after either (Parameter identity and _version do not change)"
        ]
        if (npu := _backend.torch_npu_module()) is not None:
            out.append(f"torch_npu {getattr(npu, '__version__', '?')}, CANN {_backend.cann_version()}")
        out += [v.describe() for v in self.verdicts() if v.ok]
        for state in list(self._models.values()):  # vLLM-Omni's NPU int8 linears of each attached model
            nd = Counter(why for why in state.int8.values() if why != "FRACTAL_NZ")
            if state.int8:
                out.append(f"int8: {len(state.int8)} vLLM-Omni NPU int8 linear(s), {len(state.int8) - nd.total()} in "
                           f"FRACTAL_NZ" + "".join(f"; {n} ND: {why}" for why, n in nd.items()))  # fmt: skip
        return out

    def report(self, model: nn.Module) -> dict[str, Any]:
        """Per model: names of the weights cast to NZ, the skipped layers by reason, and (where there are any)
        vLLM-Omni's NPU int8 layers, name -> FRACTAL_NZ or why not."""
        state = self._models.get(model) or _State(npu=None)
        out = {"cast": [n for n, _ in state.cast], "skipped": dict(state.skipped)}
        return out | ({"int8": dict(state.int8)} if state.int8 else {})

    def _layer_skip(
        self, npu: ModuleType, module: nn.Module, w: nn.Parameter, plain: tuple[type, ...], lora: bool, offload: bool
    ) -> str:
        """Why ``w`` stays ND ("" when it is eligible); ``plain``: the unquantized linear methods."""
        qm = getattr(module, "quant_method", None)
        int8 = w.dtype == torch.int8 and is_npu_int8(module)  # npu_quant_matmul reads an NZ x2 [OP-QMM]
        if qm is not None and not int8 and not isinstance(qm, plain):
            return SKIP_QUANTIZED
        if lora:
            return SKIP_LORA
        if offload:
            return SKIP_OFFLOAD_HOOK
        if _is_dtensor(w):
            return SKIP_DTENSOR
        if w.dtype not in (torch.float16, torch.bfloat16) and not int8:
            return f"dtype {str(w.dtype).removeprefix('torch.')}"
        if not _backend.is_npu_tensor(w):
            return SKIP_NOT_NPU
        if w.dim() != 2:
            return SKIP_NOT_2D
        if 1 in w.shape:  # F.linear's mat2 is w.T: [k, n] = [in_features, out_features] [VA-10287]
            return SKIP_NARROW
        if (fmt := npu.get_npu_format(w.data)) != ACL_FORMAT_ND:
            return f"already in format {fmt}"
        return ""

    def _attach(self, model: nn.Module) -> None:
        npu = _backend.torch_npu_module()
        self._models[model] = state = _State(npu=npu)
        if npu is None:
            state.reasons = _backend.npu_unavailable_reasons()
            return
        state.reasons = [*self.reasons_inactive(), *_config_reasons(model)]
        if state.reasons:
            return
        ran, _, refusal = self.path.guard.run("cast", lambda: self._cast_all(npu, model, state))
        if not ran:  # all or nothing: every weight cast so far goes back to ND
            done = len(state.cast)
            self._rollback(state)
            f = self.path.guard.fault("cast")
            why = (
                f"casting to FRACTAL_NZ failed after {done} weight(s) ({refusal or f'{f.kind}: {f.error}'}); "  # type: ignore[union-attr]
                "every weight was restored to ND: no weight cast"
            )
            state.reasons.append(why)
            logger.warning("vllm-omni-ascend-opt: nz_weights: %s", why)
        elif state.cast:
            logger.info("vllm-omni-ascend-opt: nz_weights cast %d linear weights to FRACTAL_NZ", len(state.cast))
            self.announce_weights_changed(model)

    @torch.no_grad()
    def _cast_all(self, npu: ModuleType, model: nn.Module, state: _State) -> None:
        """Cast every eligible weight (recorded in ``state.cast`` as it goes, so that a fault can be rolled back)."""
        linear_types, lora_types, plain = _vllm_types()
        permitted = False
        # the DiT(s) of a pipeline (transformer, transformer_2), or model itself
        subs = [(a, s) for a in ("transformer", "transformer_2") if isinstance(s := getattr(model, a, None), nn.Module)]
        for prefix, transformer in subs or [("", model)]:
            lora, offloaded = _lora_and_offload_prefixes(transformer, lora_types)
            for name, module in transformer.named_modules():
                w = getattr(module, "weight", None)
                if not isinstance(module, linear_types) or not isinstance(w, nn.Parameter):
                    continue
                why = self._layer_skip(npu, module, w, plain, _under(name, lora), _under(name, offloaded))
                full = f"{prefix}.{name}".strip(".")
                if not why:
                    if not permitted:  # the first eligible weight: the permission, on every attach
                        nz, why_not = trial_cast(npu, w.data)
                        if nz is None:
                            state.reasons.append(why_not + "; no weight cast")
                            return
                        permitted = True
                    else:
                        nz = npu.npu_format_cast(w.data, ACL_FORMAT_FRACTAL_NZ)
                    int8 = w.dtype == torch.int8
                    verdict = self._numbers(npu, module, w, nz, int8)
                    if verdict is None or not verdict.ok:
                        why_not = verdict.describe() if verdict else "the NZ check faulted"
                        if not int8:
                            self._rollback(state)
                            state.reasons.append(why_not + "; no weight cast")
                            return
                        why = f"int8 NZ refused: {why_not}"
                    elif npu.get_npu_format(nz) != ACL_FORMAT_FRACTAL_NZ:
                        why = SKIP_CAST_FAILED
                    elif slow := (self.int8 if int8 else self.path).slower(w.data, nz, module):
                        why = f"{SKIP_SLOWER} ({slow})" if int8 else SKIP_SLOWER
                    else:
                        w.data = nz
                        state.cast.append((full, w))
                        if int8:
                            state.int8[full] = "FRACTAL_NZ"
                            self.stats["int8_weights_nz"] += 1
                        continue
                if is_npu_int8(module):
                    state.int8[full] = why
                state.skipped[why] += 1

    def _numbers(self, npu: ModuleType, module: nn.Module, w: nn.Parameter, nz: torch.Tensor, int8: bool) -> Any:
        """The verdict on ``nz``: per weight shape for int8 weights, else once per (device, dtype)."""
        if int8:
            key = (str(w.device), "int8", *w.shape)
            return self.int8.decide(key, lambda: self.int8.check_int8(npu, module, nz))
        key = (str(w.device), str(w.dtype).removeprefix("torch."))
        return self.path.decide(key, lambda: self.path.check(w.data, nz))

    @torch.no_grad()
    def _rollback(self, state: _State) -> None:
        """Cast back to ND every weight cast so far (lossless: a layout change)."""
        for _name, w in state.cast:
            w.data = state.npu.npu_format_cast(w.data, ACL_FORMAT_ND)
        state.cast.clear()
        state.skipped.clear()
        state.int8.clear()

    def _detach(self, model: nn.Module) -> None:
        if (state := self._models.pop(model)).cast:  # set by every _attach
            self._rollback(state)
            self.announce_weights_changed()

    def _uninstall(self) -> None:
        self.path.clear()
        self.int8.clear()


def _vllm_types() -> tuple[tuple[type, ...], tuple[type, ...], tuple[type, ...]]:
    """(linear layer classes, LoRA wrapper classes, unquantized linear methods, subclasses included) of vLLM, lazily."""
    try:
        from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod
    except ImportError:  # pragma: no cover - vLLM always present with vLLM-Omni
        linear, plain = (nn.Linear,), ()
    else:
        linear, plain = (nn.Linear, LinearBase), (UnquantizedLinearMethod,)
    # LoRA wrappers exist only if vLLM's LoRA layers were imported (DiffusionLoRAManager does); do not import them.
    lora_base = getattr(sys.modules.get("vllm.lora.layers"), "BaseLayerWithLoRA", None)
    return linear, (lora_base,) if isinstance(lora_base, type) else (), plain


OPT = NzWeights()
