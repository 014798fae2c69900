"""`fused_attention`: Run the joint text+image attention with torch_npu.npu_fusion_attention (BSND), verified against SDPA on first use.

Why
    Without MindIE-SD, vLLM-Omni 0.30 on Ascend resolves Qwen-Image's attention to its TORCH_SDPA backend
    (``platforms/npu/platform.py`` ``get_diffusion_attn_backend_cls``), whose ``SDPAImpl.forward_npu`` permutes Q/K/V
    to BNSD, expands a 2-D key mask to [B, 1, Sq, Skv] and calls ``F.scaled_dot_product_attention``. The reference
    910B1 ablation measured 27-49 ms per image for replacing it with the fused Ascend kernel.
How
    Per model instance, never process-wide: :meth:`FusedAttention.attach` finds every ``QwenImageCrossAttention`` of
    the model and swaps its ``attn`` layer's implementation object (``Attention.attention``, an ``SDPAImpl``) for an
    instance of a per-class subclass whose ``forward`` calls ``torch_npu.npu_fusion_attention`` (BSND,
    ``head_num`` = Nq, ``scale`` = the layer's ``softmax_scale`` = 1/sqrt(D) - the kernel's default is 1 - and the
    keep-mask inverted: the kernel masks where True, SDPA keeps where True; no mask when vLLM-Omni dropped an
    all-true mask). ``detach`` puts the original object back by identity. The ``Attention`` layer keeps its parallel
    strategy, so Ulysses' ``pre_attention`` (all-to-all + joint concat) and ``post_attention`` run around the fused
    call exactly as around SDPA. Ring attention never reaches the impl (``Attention._run_ring_attention`` runs
    ``RingParallelAttention``'s own kernels), so ring layers are left alone and counted as skipped. Any call the
    kernel cannot take (float32, causal, an unsupported mask, a limit below) goes to the original SDPA object.
What it saves over torch_npu's own SDPA
    Since its torch >= 2.5 builds, torch_npu already dispatches ``F.scaled_dot_product_attention`` on Atlas A2 to
    ``npu_fusion_attention`` (BNSD). So on a current stack this optimization does **not** bring a faster attention
    kernel: it saves what stock's ``SDPAImpl.forward_npu`` does around it - the three BSND->BNSD permutes with their
    ``.contiguous()`` copies of Q/K/V, the BNSD->BSND copy of the output, and the [B, 1, S, S] mask expansion per
    layer (built here once per transformer forward, see "Mask" below). ``benchmarks/npu_check_kernels.py`` times both
    at the production shape and prints the difference; the reference 910B1 figure (27-49 ms per image) predates it.
Mask
    The kernel's [B, 1, Sq, Skv] bool mask is built once per transformer forward and reused by every layer: vLLM-Omni
    builds the joint 2-D mask from the same inputs in every block (``torch.cat`` of the text and image masks), so
    within one forward its values are the same; a forward pre-hook on each attached ``QwenImageTransformer2DModel``
    starts a new mask generation. Outside an attached transformer's forward the mask is built per call.
Verification, kernel choice, documented limits
    In :mod:`vllm_omni_ascend_opt.blocks.kernels.npu_attention` (the kernel call, the mask translation, the limits and the
    checks against SDPA, shared with ``benchmarks/npu_check_kernels.py``): verified on first use per (device, dtype)
    and again on the first real call of each shape class; a failure keeps SDPA there, with the reason. The verdicts
    live in two :class:`~vllm_omni_ascend_opt.blocks.kernels.verdicts.VerdictCache` objects (a new backend probe drops them,
    ``uninstall`` clears them).
Under torch.compile
    The swapped ``forward`` asks ``blocks.upstream.guards.tracing()`` first and then runs the stock SDPA object: no counter,
    cache, verdict or logger is touched inside a traced forward (the traced graph holds stock code); likewise the
    per-forward mask hook. NPU graph capture (no graph mode [OP-FA]) also runs SDPA, counted as ``sdpa: graph mode``.
Upstream code it relies on (``FusedAttention.upstream``, by source fingerprint)
    The seam: ``Attention._forward_impl`` routes a non-ring call to ``Attention._run_local_attention``, which ends in
    ``self.attention.forward(query, key, value, attn_metadata)``: the swapped object is what runs. Both changed in
    0.31.0rc1 (HSDP compile boundary, ``resolve_execution_path``) and 0.32.0rc1 (explicit cross-attention contracts,
    paged KV); the local call is unchanged, and for Qwen-Image's joint self-attention none of the new branches apply
    (no cross contract, no paged KV, the FP32 FlashAttention fallback is CUDA-only). ``resolve_execution_path`` is a
    capability query, not on the forward path. ``SDPAImpl.forward_npu`` (what the fused path replaces) and
    ``__init__`` (copied per instance) are unchanged; ``SDPAImpl._forward_impl`` (the verification's reference)
    moved its GQA / float-mask handling into ``_sdpa_attention`` in 0.32.0rc1: the same SDPA call for equal heads and
    bool masks. tests/test_fused_attention.py runs on every version (``make test-versions``) through the torch_npu fake.
Upstream PR
    None. vLLM-Omni fuses NPU attention only through MindIE-SD's FLASH_ATTN backend.
Removal plan
    Drop when ``SDPAImpl.forward_npu`` calls ``npu_fusion_attention`` itself or MindIE-SD is the default backend.
"""

from __future__ import annotations

import logging
import sys
import weakref
from collections import Counter
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, ClassVar

import torch
import torch.nn as nn

from vllm_omni_ascend_opt import _backend
from vllm_omni_ascend_opt.blocks.kernels import guard as kguard
from vllm_omni_ascend_opt.blocks.kernels import npu_attention as fab
from vllm_omni_ascend_opt.blocks.kernels.npu_attention import FUSED_DTYPES, KERNEL, ShapeVerdict, Verdict
from vllm_omni_ascend_opt.blocks.kernels.verdicts import VerdictCache
from vllm_omni_ascend_opt.blocks.upstream import forward_scope, guards
from vllm_omni_ascend_opt.blocks.upstream import targets as _targets
from vllm_omni_ascend_opt.blocks.upstream.fingerprints import V030, V031, V032, Upstream, same
from vllm_omni_ascend_opt.blocks.weak_lru import tensor_bytes
from vllm_omni_ascend_opt.optimization import Optimization

logger = logging.getLogger("vllm_omni_ascend_opt")
_L = _targets.ATTENTION_LAYER


# ----------------------------------------------------------------------------------------------------------------
# the swapped implementation object
# ----------------------------------------------------------------------------------------------------------------
class _FusedImplMixin:
    """Mixed in front of the stock impl class: ``forward`` takes the fused path when it can, else the stock object."""

    _ascend_opt_stock: Any
    _ascend_opt_calls: Counter

    def forward(self, query, key, value, attn_metadata=None):
        if guards.tracing():  # first: nothing mutable is read, counted or logged while dynamo traces
            return self._ascend_opt_stock.forward(query, key, value, attn_metadata)
        return OPT._forward(self, query, key, value, attn_metadata)


_FUSED_CLASSES: dict[type, type] = {}


def _fused_class(stock_cls: type) -> type:
    cls = _FUSED_CLASSES.get(stock_cls)
    if cls is None:
        cls = type(
            f"AscendFused{stock_cls.__name__}",
            (_FusedImplMixin, stock_cls),
            {"__module__": __name__, "__doc__": f"{stock_cls.__name__} whose forward runs {KERNEL} (BSND)."},
        )
        _FUSED_CLASSES[stock_cls] = cls
    return cls


def _make_fused(stock: Any) -> Any:
    impl = object.__new__(_fused_class(type(stock)))
    impl.__dict__.update({k: v for k, v in stock.__dict__.items() if k != "forward"})  # never shadow our forward
    impl._ascend_opt_stock = stock
    impl._ascend_opt_calls = Counter()
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
    equivalence = "close"
    default_enabled = True
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
        same(_targets.SDPA_BACKEND, "SDPAImpl.forward_npu", "a06f5d142abd1872"),
        same(_targets.SDPA_BACKEND, "SDPAImpl.__init__", "d075d75dc52d9396"),
        Upstream(
            _targets.SDPA_BACKEND,
            "SDPAImpl._forward_impl",
            {"93dcc56782929c57": (V030, V031), "6c3f07b099b053d1": (V032,)},
        ),
        same(_targets.TRANSFORMER, "QwenImageTransformer2DModel.forward", "5f909b9290c3e0ad"),  # one mask per forward
        _targets.CROSS_ATTENTION_FORWARD,
    )
    on_qwen_image_21 = (
        "upstream's QwenImage21SDPAImpl already runs torch_npu.npu_fusion_attention (BSND) for its unmasked calls"
    )

    def __init__(self) -> None:
        super().__init__()
        self._models: weakref.WeakKeyDictionary[nn.Module, _ModelState] = weakref.WeakKeyDictionary()
        #: First-use verdicts per (device, dtype) and per-call verdicts per shape class (one invalidation rule).
        self._verdicts: VerdictCache[Verdict] = VerdictCache(
            KERNEL + ".toy", lambda k, ok, why: Verdict(ok, k[0], k[1], _backend.backend_label(), why or "saved")
        )
        self._shapes: VerdictCache[ShapeVerdict] = VerdictCache(
            KERNEL, lambda k, ok, why: ShapeVerdict(k, ok, why or "saved verdict")
        )
        #: Faults of the checks and kernel calls (both kinds of key), retried with backoff.
        self._guard = kguard.Guard(self.name, self.stats)
        self._forward_gen = 0  # bumped by the forward pre-hook of every attached transformer
        self._mask_cache: dict[tuple, torch.Tensor] = {}
        self._mask_gen = -1

    # ----- state in words ------------------------------------------------------------------------------------
    def _process_reasons(self) -> list[str]:
        reasons = _backend.npu_unavailable_reasons()
        npu = _backend.torch_npu_module()
        if npu is not None and not hasattr(npu, KERNEL):
            reasons.append(f"{_backend.backend_label()} has no {KERNEL}")
        reasons += [v.describe() + "; SDPA kept" for v in self._verdicts.values() if not v.ok]
        shapes = self._shapes.values()
        if shapes and not any(v.ok for v in shapes):  # off only when off at every shape class seen
            reasons += [v.describe() + "; SDPA for this shape class" for v in shapes]
        return reasons

    def cache_memory(self) -> dict[str, Any]:
        """The per-forward [B, 1, S, S] mask cache (about 100 MB at 1328x1328, B=2) and the checks' scratch peak."""
        return {
            "masks": len(self._mask_cache),
            "bytes": tensor_bytes(list(self._mask_cache.values())),
            "check_scratch_peak_bytes": self._guard.scratch_peak,
        }

    def kernel_classes(self) -> dict[str, Any] | None:
        if _backend.torch_npu_module() is None:
            return None
        return kguard.tally(self._shapes.values(), self._guard.faults())

    def shape_verdicts(self) -> list[ShapeVerdict]:
        """The per-shape-class checks of the kernel on real calls so far (under the current backend probe)."""
        return self._shapes.values()

    def mask_for(self, attn_mask: torch.Tensor | None, b: int, sq: int, skv: int) -> tuple[torch.Tensor | None, str]:
        """:func:`~vllm_omni_ascend_opt.blocks.kernels.npu_attention.kernel_mask`, built once per transformer forward and
        reused by every layer of it (see the module docstring, "Mask"); a new forward generation drops the cache."""
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
        """Forward pre-hook of an attached transformer: a new forward, so masks are built afresh. Nothing while
        torch.compile traces (the layers run stock SDPA there and never read the mask cache)."""
        if guards.tracing():
            return
        self._forward_gen += 1

    def _model_reasons(self, model: nn.Module) -> list[str]:
        state = self._models.get(model)
        if state is None:
            return ["not attached to this model"]
        reasons = list(state.reasons)
        if not state.layers:
            skipped = ", ".join(f"{k}: {n}" for k, n in state.skipped.items()) or "none found"
            reasons.append(f"no joint-attention layer takes the fused path (skipped: {skipped})")
        odd = sorted(str(d).removeprefix("torch.") for d in state.dtypes if d not in FUSED_DTYPES)
        if odd:
            reasons.append(
                f"the transformer runs in {', '.join(odd)}: {KERNEL} is used for float16/bfloat16 only, SDPA runs"
            )
        reasons += [v.describe() + "; SDPA kept" for v in self._verdicts.values() if not v.ok]
        return reasons

    def notes(self) -> list[str]:
        out = [
            f"kernel: torch_npu.{KERNEL}(q, k, v, head_num=Nq, input_layout='BSND', atten_mask=~keep (B1SS) or None, "
            "scale=softmax_scale=1/sqrt(D), keep_prob=1, sparse_mode=0, inner_precise=0); chosen over "
            "npu_fused_infer_attention_score (see blocks.kernels.npu_attention); installed per Attention impl, after Ulysses' "
            "all-to-all"
        ]
        out += [v.describe() for v in self._verdicts.values() if v.ok]
        out += [v.describe() for v in self._shapes.values() if v.ok]
        out += [v.describe() + "; SDPA for this shape class" for v in self._shapes.values() if not v.ok]
        out += [f"{KERNEL} fault: {f.describe()}" for f in self._guard.faults()]
        t = self.kernel_classes()
        if t is not None:
            out.append(kguard.tally_line(KERNEL, t))
        if self.stats:
            out.append(
                f"[B,1,S,S] masks built {self.stats['mask_builds']}, reused {self.stats['mask_reuses']} (once per "
                "transformer forward, not per layer); saves vs torch_npu's own SDPA dispatch (which also runs "
                "npu_fusion_attention, BNSD): the Q/K/V/output permute copies and the per-layer mask expansion"
            )
        return out

    def verdicts(self) -> dict[tuple[str, str], Verdict]:
        """The on-device verification outcome per (device, dtype) so far (under the current backend probe)."""
        return {(v.device, v.dtype): v for v in self._verdicts.values()}

    def report(self, model: nn.Module) -> dict[str, Any]:
        """Per model: swapped layers, skipped layers by reason, and calls per path (``fused`` / ``sdpa: why``)."""
        state = self._models.get(model)
        if state is None:
            return {"swapped": 0, "skipped": {}, "calls": {}}
        calls: Counter = Counter()
        for _layer, _stock, fused in state.layers:
            calls.update(fused._ascend_opt_calls)
        return {"swapped": len(state.layers), "skipped": dict(state.skipped), "calls": dict(calls)}

    # ----- attach / detach --------------------------------------------------------------------------------------
    def _uninstall(self) -> None:
        self._guard.clear()
        self._verdicts.clear()
        self._shapes.clear()
        self._mask_cache.clear()

    def _attach(self, model: nn.Module) -> None:
        npu = _backend.torch_npu_module()
        state = _ModelState()
        self._models[model] = state
        if npu is None:
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
            qkv = getattr(getattr(module, "to_qkv", None), "weight", None)
            if isinstance(qkv, torch.Tensor):
                state.dtypes.add(qkv.dtype)
            layer = getattr(module, "attn", None)
            why = self._layer_skip_reason(layer, sdpa_cls)
            if why:
                state.skipped[why] += 1
                continue
            stock = layer.attention
            fused = _make_fused(stock)
            layer.attention = fused
            state.layers.append((layer, stock, fused))
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
        state = self._models.pop(model, None)
        if state is None:
            return
        for handle in state.hooks:
            handle.remove()
        for m in state.transformers:
            forward_scope.unwatch(m, self.name)
        for layer, stock, fused in state.layers:
            if layer.attention is fused:
                layer.attention = stock

    # ----- the forward ------------------------------------------------------------------------------------------
    def _verdict(self, npu: ModuleType, q: torch.Tensor, k: torch.Tensor, scale: float | None) -> Verdict | None:
        """The (device, dtype) verdict of :func:`~vllm_omni_ascend_opt.blocks.kernels.npu_attention.verify`, made on
        first use at this layer's Nq / Nkv / D, inside the guard; None while a fault of it waits for its retry."""
        key = (str(q.device), str(q.dtype).removeprefix("torch."))
        verdict = self._verdicts.get(key)
        if verdict is not None or self._guard.waits(key):
            return verdict
        ran, verdict, refusal = self._guard.run(
            key,
            lambda: fab.verify(npu, q.device, q.dtype, q.shape[2], q.shape[3], num_kv_heads=k.shape[2], scale=scale),
        )
        if not ran:
            if not refusal:
                return None
            verdict = Verdict(False, key[0], key[1], _backend.backend_label(), refusal)
        assert verdict is not None
        self._verdicts.put(key, verdict)
        (logger.info if verdict.ok else logger.warning)("vllm-omni-ascend-opt: %s", verdict.describe())
        return verdict

    def _forward(self, impl: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_metadata: Any):
        npu = _backend.torch_npu_module()
        why = ""
        if npu is None:
            why = "no torch_npu"
        elif getattr(impl, "causal", False):
            why = "causal"
        elif fab.graph_capture():
            why = "graph mode"
        else:
            why = fab.limits_violation(query, key, value)
        if not why:
            scale = getattr(impl, "softmax_scale", None)
            verdict = self._verdict(npu, query, key, scale)
            if verdict is None:
                why = "kernel fault (retried later)"
            elif not verdict.ok:
                why = "verification failed"
            else:
                out, why = self._fused_checked(npu, query, key, value, attn_metadata, scale)
                if out is not None:
                    impl._ascend_opt_calls["fused"] += 1
                    return out
        impl._ascend_opt_calls[f"sdpa: {why}"] += 1
        return impl._ascend_opt_stock.forward(query, key, value, attn_metadata)

    def _fused_checked(
        self, npu: ModuleType, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_metadata: Any, scale: Any
    ) -> tuple[torch.Tensor | None, str]:
        """The fused call, checked on the first real call of its shape class; (None, why) sends it to SDPA."""
        mask = getattr(attn_metadata, "attn_mask", None) if attn_metadata is not None else None
        masked, why = self.mask_for(mask, q.shape[0], q.shape[1], k.shape[1])
        if why:
            return None, why
        key = fab.shape_class(q, k, masked)
        checked = self._shapes.get(key)
        if checked is not None and not checked.ok:
            return None, "shape class failed verification"
        if self._guard.waits(key):
            return None, "kernel fault (retried later)"
        ran, out, refusal = self._guard.run(
            key, lambda: self._fused_call(npu, q, k, v, attn_metadata, scale, masked, checked is None)
        )
        if refusal:
            failed = self._shapes.put(key, ShapeVerdict(key, False, refusal))
            logger.warning("vllm-omni-ascend-opt: %s; SDPA for this shape class", failed.describe())
            return None, "kernel error"
        if not ran:
            return None, "kernel fault (retried later)"
        return out

    def warm(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, masked: torch.Tensor | None) -> bool | None:
        """Check the kernel at the (device, dtype) and the class of BSND ``q``/``k``/``v`` now (``warmup``), as the
        first real call would: the class verdict (ok), or None (no kernel, outside its limits, a fault or a
        deferral). A class already decided is not checked again."""
        npu = _backend.torch_npu_module()
        if npu is None or fab.limits_violation(q, k, v):
            return None
        scale = q.shape[-1] ** -0.5
        verdict = self._verdict(npu, q, k, scale)
        if verdict is None or not verdict.ok:
            return None if verdict is None else False
        key = fab.shape_class(q, k, masked)
        if self._shapes.get(key) is None and not self._guard.waits(key):
            self._guard.run(key, lambda: self._fused_call(npu, q, k, v, None, scale, masked, True))
        checked = self._shapes.get(key)
        return None if checked is None else checked.ok

    def _fused_call(
        self, npu: ModuleType, q: Any, k: Any, v: Any, attn_metadata: Any, scale: Any, masked: Any, check: bool
    ) -> tuple[torch.Tensor | None, str]:
        """The class check (first call of its class) and the fused call, inside the guard: what either raises
        costs this call only. (None, why): SDPA for this call."""
        key = fab.shape_class(q, k, masked)
        if check:
            if not self._guard.fits(key, q.device, fab.check_scratch_bytes(q, k)):
                return None, "check deferred (device memory)"
            made = fab.check_class(npu, q, k, v, masked, scale)
            usable = self._shapes.put(key, made).ok  # under several ranks a pass waits for the others (agree.py)
            self.stats["shape_checks"] += 1
            (logger.info if made.ok else logger.warning)(
                "vllm-omni-ascend-opt: %s%s", made.describe(), "" if made.ok else "; SDPA for this shape class"
            )
            if not usable:
                return None, "shape class failed verification" if not made.ok else "waiting for the other ranks"
        return fab.fused_forward(npu, q, k, v, attn_metadata, scale, masks=lambda *a: (masked, ""))


OPT = FusedAttention()
