"""`rope`: RoPE cos/sin tables built once per forward shape and reused in every block (:class:`Rope`).

Patches the module global ``_qwen_image_qk_norm_rope`` (looked up at call time, so it also reaches TeaCache's block
loop) and the embedders' ``forward``, memoized so the same freqs objects reach every step. Its kernel path
(``blocks.kernels.rotary.RotaryPath``) is offered in the ``ROTARY`` slot for ``joint_attention`` while installed.
"""

from __future__ import annotations

import logging
import os
import sys
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

from vllm_omni_ascend_opt import _backend
from vllm_omni_ascend_opt.blocks.kernels import rotary
from vllm_omni_ascend_opt.blocks.kernels.rope_tables import TABLE_CACHE_SIZE, version_or_none
from vllm_omni_ascend_opt.blocks.kernels.rotary import ENV_KERNEL_POLICY
from vllm_omni_ascend_opt.blocks.kernels.verdicts import Verdict
from vllm_omni_ascend_opt.blocks.upstream import forward_scope, guards
from vllm_omni_ascend_opt.blocks.upstream import targets as _targets
from vllm_omni_ascend_opt.blocks.upstream.fingerprints import ABSENT, V030, V031, V032, Upstream, same
from vllm_omni_ascend_opt.blocks.weak_lru import WeakLRU, tensor_bytes
from vllm_omni_ascend_opt.optimization import Optimization

logger = logging.getLogger("vllm_omni_ascend_opt")

#: Kernel policies (``VLLM_OMNI_ASCEND_OPT_ROPE_KERNEL``); "verified" is the pre-tier name of "pixel".
POLICIES = ("pixel", "verified", "bitwise")
#: ``QwenEmbedRope.forward`` results kept per embedder module (LRU): a few image shapes x text lengths.
EMBED_MEMO_SIZE = 8

_T = _targets.TRANSFORMER
UPSTREAM: tuple[Upstream, ...] = (
    _targets.QK_NORM_ROPE,
    _targets.FUSED_MIN_TOKENS,
    _targets.FUSED_CUDA_SUPPORTED,
    _targets.ROTARY_FORWARD_NATIVE,
    _targets.ROTARY_FORWARD_NPU,
    same(_T, "QwenEmbedRope.forward", "341bfdd26671ce38"),
    same(_T, "QwenEmbedLayer3DRope.forward", "a1198ba9ab7ff6cc"),
    Upstream(_T, "QwenEmbedRope.__init__", {"2a0b2ac6aef42c5a": (V030, V031), "77e96f6224e3eb62": (V032,)}),
    Upstream(_T, "QwenEmbedLayer3DRope.__init__", {"d423f2c06a4e9ea3": (V030, V031), "c954f35fd13f7112": (V032,)}),
    Upstream(_T, "QwenEmbedRope._compute_video_freqs", {"11b65b39fc21a8ca": (V030, V031), "96ac02ec4d50008c": (V032,)}),
    Upstream(_T, "QwenEmbedRope._build_video_freqs", {ABSENT: (V030, V031), "179ee8c1a00d4813": (V032,)}),
    Upstream(
        _T, "QwenEmbedLayer3DRope._compute_video_freqs", {"5a6c0da19369f69d": (V030, V031), "65d48e3cfc4c6269": (V032,)}
    ),
    Upstream(
        _T,
        "QwenEmbedLayer3DRope._compute_condition_freqs",
        {"46e3a10bb507dadb": (V030, V031), "80e7da9ae10eb788": (V032,)},
    ),
    Upstream(_T, "QwenEmbedLayer3DRope._build_video_freqs", {ABSENT: (V030, V031), "5660f78680451cf4": (V032,)}),
    Upstream(_T, "QwenEmbedLayer3DRope._build_condition_freqs", {ABSENT: (V030, V031), "cfa82d5f72c951d9": (V032,)}),
    Upstream(_T, "_cached_rope_freqs", {ABSENT: (V030, V031), "9bf7133c01db557c": (V032,)}),
    same(_T, "ImageRopePrepare.forward", "3a1ca5fba25a713c"),
)


class Rope(Optimization):
    name = "rope"
    summary = "Build RoPE cos/sin tables once per forward shape and reuse them in every block; on Ascend apply them with a verified torch_npu.npu_rotary_mul (interleave)."
    why = (
        "Stock converts the complex freqs to cos/sin in every block for both streams, and forward_native re-expands "
        "them and negates/stacks x on every call (10 launches per q/k), as does Ascend without MindIE-SD."
    )
    how = (
        "cos/sin tables built once per freqs tensor and dtype (weakly keyed LRU) and the embedder memoized per shape; "
        "the portable x*cos + swap(x)*sin_signed is bitwise stock (4 launches); on NPU one npu_rotary_mul "
        "(interleave), verified per (device, dtype, head_dim) and per shape class against an fp32 reference and "
        "stock's own error: pixel (VLLM_OMNI_ASCEND_OPT_ROPE_KERNEL=bitwise keeps it exact)."
    )
    upstream_pr = "vllm-omni #4043 (open): npu_rotary_mul per call, no cached tables; #7594 (open): CUDA-only fusion."
    #: exact on the portable path; pixel with the NPU kernel (see :meth:`tier`).
    equivalence = "pixel"
    requires = ("NPU kernel path: torch_npu with npu_rotary_mul rotary_mode='interleave'",)
    target_modules = (_targets.TRANSFORMER,)
    regions = frozenset({"block", "transformer"})
    acts_without_attach = True
    watches_forwards = True  # the guard and the tables once per forward
    upstream = UPSTREAM
    on_qwen_image_21 = (
        "upstream applies its RoPE there with torch_npu.npu_rotary_mul and tables cached per freqs "
        "(_apply_qwen_image21_rotary_emb_npu); no Qwen-Image (1.x) embedder or qk-norm-rope to patch"
    )
    removal_plan = "Drop when vLLM-Omni builds cos/sin once per forward and calls npu_rotary_mul (vllm-omni #4043)."

    #: Set False to keep the portable path even where torch_npu is present.
    use_npu_kernel: bool = True
    #: Accept the NPU kernel only if it is bitwise-equal to stock's math; None: from the env (``ENV_KERNEL_POLICY``).
    require_bitwise_kernel: bool | None = None

    def __init__(self) -> None:
        super().__init__()
        #: Tables, kernel verdicts and the backend choice (also serves ``joint_attention``'s calls while installed).
        self.rotary = rotary.RotaryPath(self, self.stats, self.name)
        self._embed_memo: weakref.WeakKeyDictionary[nn.Module, WeakLRU] = weakref.WeakKeyDictionary()
        self._bad_policy: set[str] = set()

    def cache_memory(self) -> dict[str, Any]:
        tables = self.rotary.tables
        memo = [out for m in list(self._embed_memo.values()) for out in m.values()]
        return {
            "tables": len(tables),
            "table_cap": TABLE_CACHE_SIZE,
            "bytes": tables.nbytes(),
            "embed_memo_entries": len(memo),
            "embed_memo_bytes": tensor_bytes(memo),
            "check_scratch_peak_bytes": self.rotary.guard.scratch_peak,
        }

    def _model_reasons(self, model: nn.Module) -> list[str]:
        mod = sys.modules.get(_targets.TRANSFORMER)
        transformer = getattr(model, "transformer", model)
        if mod is None or not isinstance(transformer, mod.QwenImageTransformer2DModel):
            return ["no QwenImageTransformer2DModel in this model: rope only changes Qwen-Image's RoPE"]
        return []

    def tier(self) -> str:
        """``pixel`` where the NPU kernel is (or, once verified, will be) used; ``exact`` on the portable path."""
        mod = _backend.torch_npu_module()
        if not self.use_npu_kernel or mod is None or getattr(mod, "npu_rotary_mul", None) is None:
            return "exact"
        if self.requires_bitwise():
            return "exact"  # only a bitwise-equal kernel is taken: exact either way
        # off once every first-use check, or every shape-class check, so far failed
        may_run = all(not vs or any(v.ok for v in vs) for vs in (self.verdicts(), self.shape_verdicts()))
        return "pixel" if may_run else "exact"

    def notes(self) -> list[str]:
        out = [
            f"{ENV_KERNEL_POLICY}={v!r} is not one of {', '.join(POLICIES)}: the 'bitwise' policy is used"
            for v in sorted(self._bad_policy)
        ]
        out.append(
            f"tier here: {self.tier()} (exact: portable path, bitwise stock; pixel: npu_rotary_mul, fp32 inside, "
            f"uint8-identical images); kernel policy {'bitwise' if self.requires_bitwise() else 'pixel'}"
        )
        if _backend.torch_npu_module() is None:
            why = "; ".join(_backend.npu_unavailable_reasons()) or "torch_npu unavailable"
            out.append(
                f"NPU kernel npu_rotary_mul not in use: {why}. Portable path: cached cos/sin tables with vLLM-Omni's "
                "own rotary math, bitwise-identical to stock."
            )
        elif not self.use_npu_kernel:
            out.append("NPU kernel npu_rotary_mul disabled (Rope.use_npu_kernel=False); portable path in use.")
        else:
            if not self.verdicts():
                out.append(
                    "torch_npu present: npu_rotary_mul(interleave) is checked against the fp32 portable reference on "
                    "first use per (device, dtype, head_dim), and on the first real call of each shape class."
                )
            out.extend(self.rotary.notes())
        if s := self.stats:
            out.append(
                f"tables built {s['table_builds']}, reused {s['table_hits']}; shape memo hits {s['embed_memo_hits']}; "
                f"rotary calls: npu {s['kernel_calls']}, portable {s['portable_calls']}, "
                f"stock kernel with cached tables {s['delegate_calls']}, stock {s['stock_calls']}"
            )
        return out

    def kernel_classes(self) -> dict[str, Any] | None:
        return None if _backend.torch_npu_module() is None or not self.use_npu_kernel else self.rotary.tally()

    def verdicts(self) -> list[Verdict]:
        """The first-use checks of the kernel per (device, dtype, head_dim), for the current backend."""
        return self.rotary.firsts.values()

    def shape_verdicts(self) -> list[Verdict]:
        """The per-shape-class checks of the kernel on real calls so far, for the current backend."""
        return self.rotary.classes.values()

    def _install(self) -> None:
        mod = sys.modules[_targets.TRANSFORMER]
        self.patches.set(mod, "_qwen_image_qk_norm_rope", self._make_qk_norm_rope(mod._qwen_image_qk_norm_rope))
        for cls_name in ("QwenEmbedRope", "QwenEmbedLayer3DRope"):
            if (cls := getattr(mod, cls_name, None)) is not None:
                self.patches.set(cls, "forward", self._make_embed_forward(cls.forward))
        rotary.ROTARY.provide(self.rotary)

    def _uninstall(self) -> None:
        rotary.ROTARY.withdraw(self.rotary)
        self.rotary.clear()  # tables and kernel verdicts
        self._embed_memo.clear()
        self._bad_policy.clear()

    def requires_bitwise(self) -> bool:
        """The kernel policy: the attribute, else the env (default ``pixel``; an unknown value: ``bitwise``, logged)."""
        if self.require_bitwise_kernel is not None:
            return self.require_bitwise_kernel
        raw = os.environ.get(ENV_KERNEL_POLICY, "pixel").strip().lower()
        if raw not in POLICIES:
            if raw not in self._bad_policy:
                logger.warning(
                    "vllm-omni-ascend-opt: rope: %s=%r is not one of %s; using 'bitwise'",
                    ENV_KERNEL_POLICY,
                    raw,
                    ", ".join(POLICIES),
                )
                self._bad_policy.add(raw)
            return True
        return raw == "bitwise"

    def _make_qk_norm_rope(self, original: Callable[..., Any]) -> Callable[..., Any]:
        opt = self
        mod = sys.modules[_targets.TRANSFORMER]

        def _qwen_image_qk_norm_rope(
            q: torch.Tensor,
            k: torch.Tensor,
            norm_q: nn.Module,
            norm_k: nn.Module,
            freqs: torch.Tensor,
            rope: nn.Module,
            eps: float,
            *,
            use_fused: bool = True,
        ) -> tuple[torch.Tensor, torch.Tensor]:
            """vLLM-Omni's ``_qwen_image_qk_norm_rope`` with cached cos/sin (and the verified NPU kernel)."""
            if guards.tracing():  # first: dynamo traces stock code, nothing here is read or counted
                return original(q, k, norm_q, norm_k, freqs, rope, eps, use_fused=use_fused)
            if (
                forward_scope.decide("rope.call_reason", guards.eager_call_reason) is not None  # once per forward
                or q.dim() != 4
                or freqs.dim() != 2
                or not freqs.is_complex()
                or freqs.shape[0] != q.shape[1]
                or freqs.shape[-1] * 2 > q.shape[-1]
                or (  # stock's fused CUDA (Triton) branch, same condition in the same order
                    use_fused
                    and q.shape[0] * q.shape[1] >= mod.fused_qk_norm_rope_min_tokens(mod._FUSED_MIN_TOKENS)
                    and mod._fused_cuda_supported(q, k, q.shape[-1], freqs.shape[-1] * 2, interleaved=True)
                )
            ):
                opt.stats["stock_calls"] += 1
                return original(q, k, norm_q, norm_k, freqs, rope, eps, use_fused=use_fused)
            q, k = norm_q(q), norm_k(k)
            return opt._rotate(q, freqs, rope), opt._rotate(k, freqs, rope)

        _qwen_image_qk_norm_rope.__wrapped__ = original  # type: ignore[attr-defined]
        return _qwen_image_qk_norm_rope

    def _rotate(self, x: torch.Tensor, freqs: torch.Tensor, rope: nn.Module) -> torch.Tensor:
        """Stock's ``rope(x, cos, sin)`` with the cached tables of ``freqs`` in ``x``'s dtype (rotary service)."""
        tables = forward_scope.decide(
            ("rope.tables", id(freqs), x.dtype), lambda: self.rotary.tables.get(freqs, x.dtype)
        )
        return self.rotary.apply(x, tables, freqs, rope)

    def _make_embed_forward(self, original: Callable[..., Any]) -> Callable[..., Any]:
        opt = self

        def forward(module: nn.Module, video_fhw: Any, txt_seq_lens: Any, device: Any) -> Any:
            """``QwenEmbedRope.forward`` memoized (LRU per module) while ``pos_freqs``/``neg_freqs`` stay the same."""
            if guards.tracing() or torch.is_grad_enabled():  # tracing first: nothing mutable read while tracing
                return original(module, video_fhw, txt_seq_lens, device)
            key = _embed_key(module, video_fhw, txt_seq_lens, device)
            memo = opt._embed_memo.get(module)
            hit = memo.get(*key) if key is not None and memo is not None else None
            if hit is not None:
                opt.stats["embed_memo_hits"] += 1
                return hit
            out = original(module, video_fhw, txt_seq_lens, device)
            after = _embed_key(module, video_fhw, txt_seq_lens, device)  # forward may have moved the tables
            if after is not None:
                opt._embed_memo.setdefault(module, WeakLRU(EMBED_MEMO_SIZE)).put(*after, out)
            return out

        forward.__wrapped__ = original  # type: ignore[attr-defined]
        return forward


def _plain(obj: Any) -> Any:
    """Nested lists/tuples of ints as nested tuples of ints; None when anything else is inside."""
    if isinstance(obj, int) and not isinstance(obj, bool):
        return int(obj)
    if isinstance(obj, (list, tuple)):
        items = tuple(_plain(o) for o in obj)
        return None if any(i is None for i in items) else (type(obj).__name__, items)
    return None


def _embed_key(module: nn.Module, video_fhw: Any, txt_seq_lens: Any, device: Any) -> tuple[tuple, tuple] | None:
    """(hashable key, tensors whose identity it names) for one ``QwenEmbedRope.forward`` call, or None."""
    fhw, lens = _plain(video_fhw), _plain(txt_seq_lens)
    pos, neg = getattr(module, "pos_freqs", None), getattr(module, "neg_freqs", None)
    if fhw is None or lens is None or not isinstance(pos, torch.Tensor) or not isinstance(neg, torch.Tensor):
        return None
    try:
        dev = str(torch.device(device))
    except (TypeError, RuntimeError):
        return None
    key = (
        fhw,
        lens,
        dev,
        id(pos),
        id(neg),
        version_or_none(pos),
        version_or_none(neg),
        bool(getattr(module, "scale_rope", False)),
        tuple(getattr(module, "axes_dim", ())),
        getattr(module, "theta", None),
    )
    return key, (pos, neg)


OPT = Rope()
