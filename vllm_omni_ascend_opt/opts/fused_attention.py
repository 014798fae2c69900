"""`fused_attention`: the joint text+image attention through ``torch_npu.npu_fusion_attention`` (BSND).

Per model instance, each joint attention layer whose impl is stock ``SDPAImpl`` gets an impl whose ``forward`` takes
the fused path where it can, else the stock object's; the key mask is built once per transformer forward.
"""

from __future__ import annotations

import functools
import sys
import weakref
from collections import Counter
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, ClassVar

import torch
import torch.nn as nn

from vllm_omni_ascend_opt import _backend
from vllm_omni_ascend_opt.blocks.kernels import npu_attention as fab
from vllm_omni_ascend_opt.blocks.kernels.npu_attention import FUSED_DTYPES, KERNEL
from vllm_omni_ascend_opt.blocks.kernels.verdicts import Verdict
from vllm_omni_ascend_opt.blocks.upstream import forward_scope, guards
from vllm_omni_ascend_opt.blocks.upstream import targets as _targets
from vllm_omni_ascend_opt.blocks.upstream.fingerprints import V030, V031, V032, Upstream, same
from vllm_omni_ascend_opt.blocks.weak_lru import tensor_bytes
from vllm_omni_ascend_opt.optimization import Optimization

_L, _S = _targets.ATTENTION_LAYER, _targets.SDPA_BACKEND


class _FusedImplMixin:
    """Mixed in front of the stock impl class: ``forward`` takes the fused path when it can, else the stock object."""

    _ascend_opt_stock: Any
    _ascend_opt_calls: Counter

    def forward(self, query, key, value, attn_metadata=None):
        if guards.tracing():  # first: nothing mutable is read, counted or logged while dynamo traces
            return self._ascend_opt_stock.forward(query, key, value, attn_metadata)
        return OPT._forward(self, query, key, value, attn_metadata)


@functools.cache
def _fused_class(stock_cls: type) -> type:
    return type(
        f"AscendFused{stock_cls.__name__}",
        (_FusedImplMixin, stock_cls),
        {"__module__": __name__, "__doc__": f"{stock_cls.__name__} whose forward runs {KERNEL} (BSND)."},
    )


def _make_fused(stock: Any) -> Any:
    impl = object.__new__(_fused_class(type(stock)))
    impl.__dict__.update({k: v for k, v in stock.__dict__.items() if k != "forward"})  # never shadow our forward
    impl.__dict__.update(_ascend_opt_stock=stock, _ascend_opt_calls=Counter())
    return impl


@dataclass
class _ModelState:
    layers: list[tuple[nn.Module, Any, Any]] = field(default_factory=list)  # (Attention layer, stock impl, fused)
    hooks: list[Any] = field(default_factory=list)  # forward pre-hook handles (one per transformer)
    transformers: list[nn.Module] = field(default_factory=list)
    skipped: Counter = field(default_factory=Counter)
    dtypes: set[torch.dtype] = field(default_factory=set)
    reasons: list[str] = field(default_factory=list)


class FusedAttention(Optimization):
    name = "fused_attention"
    summary = "Run the joint text+image attention with torch_npu.npu_fusion_attention (BSND), verified against SDPA on first use."
    why = "SDPAImpl.forward_npu permutes Q/K/V to BNSD and expands the key mask per call; the kernel takes BSND."
    how = (
        "npu_fusion_attention(BSND, the layer's scale, the inverted keep-mask) behind the NPU dispatch, verified per "
        "(device, dtype) and per shape class against an fp32 reference with stock SDPA's own error as the budget; "
        "SDPA where refused, for fp32, causal calls, tracing, graph capture and shapes outside the documented limits."
    )
    upstream_pr = "No open PR changes SDPAImpl.forward_npu; vllm-omni #7580 (open) targets torch.compile on Ascend."
    equivalence = "close"
    requires = ("torch_npu with npu_fusion_attention; an Ascend NPU; fp16/bf16",)
    target_modules = (_targets.TRANSFORMER,)
    parallel_support: ClassVar[dict[str, str]] = {
        "single": "supported",
        "ulysses": "supported",
        "ring": "off: ring attention runs RingParallelAttention's own kernels and never reaches the swapped impl",
        "cfg_parallel": "supported",
        "tensor_parallel": "supported",
        "allgather": (
            "off: all-gather sequence parallelism needs vLLM-Omni's TRTLLM_ATTN backend (CUDA), whose impl is not "
            "SDPAImpl: its layers are left alone"
        ),
        "vae_patch_parallel": "supported",
    }
    regions = frozenset({"block"})
    removal_plan = "Drop when SDPAImpl.forward_npu calls npu_fusion_attention itself or MindIE-SD is the default."
    upstream = (
        Upstream(
            _L,
            "Attention._forward_impl",
            {"e9933ae271b33725": (V030,), "00e9019e535fd2f5": (V031,), "abe34517ec064868": (V032,)},
        ),
        Upstream(
            _L,
            "Attention._run_local_attention",
            {"993e1e36560fe86f": (V030,), "44ccc81fbd7f347d": (V031,), "80475767d74d76da": (V032,)},
        ),
        same(_L, "Attention._run_ring_attention", "c21123d6776e4b1d"),
        same(_S, "SDPAImpl.forward_npu", "a06f5d142abd1872"),
        same(_S, "SDPAImpl.__init__", "d075d75dc52d9396"),
        Upstream(_S, "SDPAImpl._forward_impl", {"93dcc56782929c57": (V030, V031), "6c3f07b099b053d1": (V032,)}),
        same(_targets.TRANSFORMER, "QwenImageTransformer2DModel.forward", "5f909b9290c3e0ad"),  # one mask per forward
        _targets.CROSS_ATTENTION_FORWARD,
    )
    on_qwen_image_21 = (
        "upstream's QwenImage21SDPAImpl already runs torch_npu.npu_fusion_attention (BSND) for its unmasked calls"
    )

    def __init__(self) -> None:
        super().__init__()
        self._models: weakref.WeakKeyDictionary[nn.Module, _ModelState] = weakref.WeakKeyDictionary()
        self.path = fab.AttentionPath(self.name, self.stats)
        self._forward_gen = 0  # bumped by the forward pre-hook of every attached transformer
        self._mask_cache: dict[tuple, torch.Tensor] = {}
        self._mask_gen = -1

    def _process_reasons(self) -> list[str]:
        reasons = _backend.npu_unavailable_reasons()
        npu = _backend.torch_npu_module()
        if npu is not None and not hasattr(npu, KERNEL):
            reasons.append(f"{_backend.backend_label()} has no {KERNEL}")
        reasons += [v.describe() for v in self.path.firsts.values() if not v.ok]
        shapes = self.path.classes.values()
        if shapes and not any(v.ok for v in shapes):  # off only when off at every shape class seen
            reasons += [v.describe() for v in shapes]
        return reasons

    def cache_memory(self) -> dict[str, Any]:
        """The per-forward [B, 1, S, S] mask cache and the checks' scratch peak."""
        return {
            "masks": len(self._mask_cache),
            "bytes": tensor_bytes(list(self._mask_cache.values())),
            "check_scratch_peak_bytes": self.path.guard.scratch_peak,
        }

    def kernel_classes(self) -> dict[str, Any] | None:
        return None if _backend.torch_npu_module() is None else self.path.tally()

    def shape_verdicts(self) -> list[Verdict]:
        """The per-shape-class checks of the kernel on real calls so far (under the current backend probe)."""
        return self.path.classes.values()

    def mask_for(self, attn_mask: torch.Tensor | None, b: int, sq: int, skv: int) -> tuple[torch.Tensor | None, str]:
        """``npu_attention.kernel_mask``, built once per transformer forward and reused by every layer of it."""
        if attn_mask is None or self._forward_gen == 0:
            return fab.kernel_mask(attn_mask, b, sq, skv)
        if self._mask_gen != self._forward_gen:
            self._mask_cache.clear()
            self._mask_gen = self._forward_gen
        key = (tuple(attn_mask.shape), attn_mask.dtype, str(attn_mask.device), b, sq, skv)
        hit = self._mask_cache.get(key)
        if hit is not None:
            self.stats["mask_reuses"] += 1
            return hit, ""
        masked, why = fab.kernel_mask(attn_mask, b, sq, skv)
        if masked is not None:
            self._mask_cache[key] = masked
            self.stats["mask_builds"] += 1
        return masked, why

    def _new_forward(self, module: nn.Module, args: Any) -> None:
        """Forward pre-hook of an attached transformer: masks are built afresh (not while tracing: stock SDPA)."""
        if guards.tracing():
            return
        self._forward_gen += 1

    def _model_reasons(self, model: nn.Module) -> list[str]:
        state = self._models[model]  # asked only while attached
        reasons = list(state.reasons)
        if not state.layers:
            skipped = ", ".join(f"{k}: {n}" for k, n in state.skipped.items()) or "none found"
            reasons.append(f"no joint-attention layer takes the fused path (skipped: {skipped})")
        if odd := sorted(str(d).removeprefix("torch.") for d in state.dtypes if d not in FUSED_DTYPES):
            reasons.append(
                f"the transformer runs in {', '.join(odd)}: {KERNEL} is used for float16/bfloat16 only, SDPA runs"
            )
        return reasons  # the first-use refusals are process reasons

    def notes(self) -> list[str]:
        out = [
            f"kernel: torch_npu.{KERNEL}(q, k, v, head_num=Nq, input_layout='BSND', atten_mask=~keep (B1SS) or None, "
            "scale=softmax_scale=1/sqrt(D), keep_prob=1, sparse_mode=0, inner_precise=0); chosen over "
            "npu_fused_infer_attention_score (see blocks.kernels.npu_attention); installed per Attention impl, after Ulysses' "
            "all-to-all"
        ]
        if self.kernel_classes() is not None:
            out += self.path.notes()
        if self.stats:
            out.append(
                f"[B,1,S,S] masks built {self.stats['mask_builds']}, reused {self.stats['mask_reuses']} (once per "
                "transformer forward, not per layer); saves vs torch_npu's own SDPA dispatch (which also runs "
                "npu_fusion_attention, BNSD): the Q/K/V/output permute copies and the per-layer mask expansion"
            )
        return out

    def verdicts(self) -> dict[tuple, Verdict]:
        """The first-use check per (device, dtype) so far (under the current backend probe)."""
        return {v.key: v for v in self.path.firsts.values()}

    def report(self, model: nn.Module) -> dict[str, Any]:
        """Per model: swapped layers, skipped layers by reason, and calls per path (``fused`` / ``sdpa: why``)."""
        state = self._models.get(model) or _ModelState()
        calls = sum((fused._ascend_opt_calls for _layer, _stock, fused in state.layers), Counter())
        return {"swapped": len(state.layers), "skipped": dict(state.skipped), "calls": dict(calls)}

    def _uninstall(self) -> None:
        self.path.clear()
        self._mask_cache.clear()

    def _attach(self, model: nn.Module) -> None:
        self._models[model] = state = _ModelState()
        if _backend.torch_npu_module() is None:
            state.reasons = _backend.npu_unavailable_reasons()
            return
        transformer_mod = sys.modules.get(_targets.TRANSFORMER)
        cross_cls = getattr(transformer_mod, "QwenImageCrossAttention", None)
        sdpa_cls = getattr(sys.modules.get(_targets.SDPA_BACKEND), "SDPAImpl", None)
        if cross_cls is None or sdpa_cls is None:
            state.reasons = ["vLLM-Omni's Qwen-Image transformer / SDPA backend is not imported"]
            return
        for module in model.modules():
            if not isinstance(module, cross_cls):
                continue
            lin = getattr(module, "to_qkv", None)
            qkv = getattr(lin, "weight", None)
            if isinstance(qkv, torch.Tensor):  # a quantized linear keeps its activations' dtype (vLLM's orig_dtype)
                state.dtypes.add(qkv.dtype if qkv.is_floating_point() else getattr(lin, "orig_dtype", qkv.dtype))
            layer = getattr(module, "attn", None)
            if why := self._layer_skip_reason(layer, sdpa_cls):
                state.skipped[why] += 1
                continue
            fused = _make_fused(layer.attention)
            state.layers.append((layer, layer.attention, fused))
            layer.attention = fused
        tr_cls = getattr(transformer_mod, "QwenImageTransformer2DModel", None)
        if state.layers and tr_cls is not None:
            state.transformers = [m for m in model.modules() if isinstance(m, tr_cls)]
            state.hooks = [m.register_forward_pre_hook(self._new_forward) for m in state.transformers]
            for m in state.transformers:
                forward_scope.watch(m, self.name)  # the fault-backoff clock counts its forwards

    @staticmethod
    def _layer_skip_reason(layer: Any, sdpa_cls: type) -> str:
        if layer is None or not hasattr(layer, "attention"):
            return "no vLLM-Omni Attention layer"
        if getattr(layer, "_has_custom_attention", False):
            return "model-owned custom attention kernel"
        if getattr(layer, "use_ring", False):
            return "ring sequence parallelism"
        impl = layer.attention
        if isinstance(impl, _FusedImplMixin):
            return "already fused (attached through another model)"
        if type(impl) is not sdpa_cls:  # e.g. FLASH_ATTN (MindIE-SD) or a model-owned override: left alone
            return f"impl {type(impl).__name__} (not vLLM-Omni's SDPAImpl)"
        return ""

    def _detach(self, model: nn.Module) -> None:
        state = self._models.pop(model)  # set by every _attach
        for handle in state.hooks:
            handle.remove()
        for m in state.transformers:
            forward_scope.unwatch(m, self.name)
        for layer, stock, fused in state.layers:
            if layer.attention is fused:
                layer.attention = stock

    def _verdict(self, npu: ModuleType, q: torch.Tensor, k: torch.Tensor, scale: float | None) -> Verdict | None:
        """The first-use check at (device, dtype), made at this layer's Nq / Nkv / D; None while a fault of it waits."""
        key = (str(q.device), str(q.dtype).removeprefix("torch."))
        return self.path.decide(
            key,
            lambda: self.path.first_check(
                npu, q.device, q.dtype, q.shape[2], q.shape[3], num_kv_heads=k.shape[2], scale=scale
            ),
        )

    def _forward(self, impl: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_metadata: Any):
        npu = _backend.torch_npu_module()
        if npu is None:
            why = "no torch_npu"
        elif getattr(impl, "causal", False):
            why = "causal"
        elif _backend.graph_capture_reason() is not None:  # [OP-FA]: no graph mode
            why = "graph mode"
        else:
            why = fab.limits_violation(query, key, value)
        if not why:
            out, why = self._fused_checked(npu, impl, query, key, value, attn_metadata)
            if out is not None:
                impl._ascend_opt_calls["fused"] += 1
                return out
        impl._ascend_opt_calls[f"sdpa: {why}"] += 1
        return impl._ascend_opt_stock.forward(query, key, value, attn_metadata)

    def _fused_checked(
        self, npu: ModuleType, impl: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_metadata: Any
    ) -> tuple[torch.Tensor | None, str]:
        """The fused call once the kernel is verified here (and its class on its first call); (None, why): SDPA."""
        scale = getattr(impl, "softmax_scale", None)
        verdict = self._verdict(npu, q, k, scale)
        if verdict is None or not verdict.ok:
            return None, "kernel fault (retried later)" if verdict is None else "verification failed"
        masked, why = self.mask_for(getattr(attn_metadata, "attn_mask", None), q.shape[0], q.shape[1], k.shape[1])
        if why:
            return None, why
        key = fab.shape_class(q, k, masked)
        out = self._call(npu, key, q, k, v, masked, scale)
        return (out, "") if out is not None else (None, self.path.why_stock(key))

    def _call(self, npu: ModuleType, key: tuple, q: Any, k: Any, v: Any, masked: Any, scale: Any) -> Any:
        s = float(scale) if scale is not None else q.shape[-1] ** -0.5
        return self.path.call(
            key,
            lambda: fab.call_kernel(npu, q, k, v, masked, s),
            lambda _out: self.path.class_check(npu, q, k, v, masked, scale),
            lambda: fab.check_scratch_bytes(q, k),
            q.device,
            stock=lambda: fab.stock_sdpa(q, k, v, masked, s),
            more=lambda: self.path.more(npu, q, k, v, masked, scale),
        )

    def warm(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, masked: torch.Tensor | None) -> bool | None:
        """Check the kernel for BSND ``q``/``k``/``v`` now (``warmup``): the class verdict, or None (not checked)."""
        npu = _backend.torch_npu_module()
        if npu is None or fab.limits_violation(q, k, v):
            return None
        verdict = self._verdict(npu, q, k, q.shape[-1] ** -0.5)
        if verdict is None or not verdict.ok:
            return None if verdict is None else False
        key = fab.shape_class(q, k, masked)
        if self.path.settled(key) is None:
            self._call(npu, key, q, k, v, masked, None)
        return self.path.settled(key)


OPT = FusedAttention()
