"""`joint_attention`: Join the text and image streams once after their QKV projections; QK RMSNorms and RoPE run once on the joint sequence (bitwise stock).

Patch header (vllm-ascend ``vllm_ascend/patch/`` style)
-------------------------------------------------------
Patched symbol (``vllm_omni/diffusion/models/qwen_image/qwen_image_transformer.py``; vLLM-Omni 0.30.0, 0.31.0rc1,
0.32.0rc1, by the source fingerprints in ``JointAttention.upstream``):
``QwenImageCrossAttention.forward`` (class attribute; the block - stock or ``shared_modulation``'s body - calls
``block.attn(...)``, so both reach it).

Why: from the two QKV projections to the attention call stock runs, per block, four RMSNorms (one per stream for q
and k: 6 kernel launches each in fp32, 8 in bf16 where the norm upcasts and casts back - torch_npu 2.13 registers no
``aten::rms_norm`` kernel, so it runs as these pieces on an NPU too), four RoPE applications (one per stream for q and
k) and three ``cat``s joining q, k and v of the two streams.

How (every element sees exactly stock's operations in stock's order, so the output is bitwise stock):

* One ``cat`` of ``txt_qkv`` and ``img_qkv`` along the sequence (text first, as stock joins them); q/k/v are views.
* The QK RMSNorms once on the joint sequence (:func:`joint_rms_norm`): torch 2.13's ``rms_norm`` composite on CPU
  (and, piece by piece, on an NPU) is ``x.to(opmath)``, ``pow(2)``, ``mean(-1, keepdim)``, ``add_(eps)``,
  ``rsqrt``, ``mul``, ``mul(weight)`` (fp32 opmath: the weight multiply happens before the one cast back), then
  ``to(dtype)``. Every step is per row or element-wise, so it runs once on the joint rows; only the weight multiply
  differs per stream (text rows ``norm_added_q/k.weight``, image rows ``norm_q/k.weight``): two ``mul(..., out=)``
  into the two row ranges of one buffer, no per-row weight table to keep in sync with the weights.
* RoPE once on the joint sequence with a joint table: the joint complex freqs ``cat(txt_freqs, vid_freqs)`` are built
  once per (vid, txt) freqs pair (cached weakly on both, so once per shape with ``rope``'s embedder memo, once per
  forward without it; a bounded LRU of :data:`JOINT_FREQS_CACHE_SIZE`) and rotated through the shared rotary blocks:
  the rotary service ``rope`` switches on while installed (:func:`vllm_omni_ascend_opt.blocks.rotary.active`: its
  table cache, verified NPU kernel and counters), else the portable math of
  :mod:`vllm_omni_ascend_opt.blocks.rope_tables` with this optimization's own table cache (bitwise stock's
  ``RotaryEmbedding.forward_native``; see ``rope``).
* The attention call, output split and ``to_out``/``to_add_out`` as stock; the padded-text key mask is built as
  stock builds it (``encoder_hidden_states_mask`` / ``hidden_states_mask`` are handled exactly). Under Ulysses/Ring
  sequence parallelism (stock's ``AttentionMetadata(joint_query=txt...)`` branch) the image and text parts are views
  of the joint tensors: the same values as stock's.
* With ``qk_norm`` attached and its kernel present (asked of :func:`vllm_omni_ascend_opt.blocks.rms_norm.kernel_ready`,
  never of ``qk_norm`` itself), the norms run per stream on stock's views (one ``npu_rms_norm`` each: gamma must be
  [D]) and q, k, v are joined by one ``cat`` each (v stays contiguous for the attention kernel); RoPE still runs
  once on the joint sequence. See ``qk_norm`` for the launch count.

Launches per block, fp32 tiny, warm request (the CPU bitwise default stack): 74 -> 54 (norms 24 -> 14, RoPE
16 -> 8, cats 3 -> 1).

While ``torch.compile`` traces, the patched forward runs stock code at once (checked first: nothing is read,
counted or logged, so vLLM-Omni's regional compile sees no graph break). Falls back to stock, with the reason
counted (:meth:`JointAttention.fallback_reasons`), under autograd, graph capture, when the norms are not plain
``nn.RMSNorm`` with weights and one ``eps`` (Identity for ``qk_norm=False``, hooks, other classes), when the two
streams' projections differ in heads or dtype, when the freqs do not match the sequence lengths, when stock's RoPE
is not vLLM-Omni's native rotary math (MindIE-SD, CUDA kernels: their results on a joint sequence are not proven
equal), and where stock takes its fused CUDA qk-norm-rope (Triton) path (>= 2048 tokens on CUDA): that kernel stays
stock's. Quantized or LoRA-wrapped projections are called as modules, like stock, and their outputs joined.
Non-contiguous views reach the attention (v is a view of the joint projection): bitwise on CPU SDPA and through
``fused_attention`` (which makes its inputs contiguous) - tested.

Upstream PR: none yet.
Removal plan: drop when vLLM-Omni's ``QwenImageCrossAttention`` joins the streams once and normalizes/rotates the
joint sequence (or ships a fused qk-norm-rope kernel for NPU).
"""

from __future__ import annotations

import functools
import sys
import weakref
from collections import Counter, OrderedDict
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

from vllm_omni_ascend_opt.blocks import direct_calls, forward_scope, guards, rms_norm, rope_tables, rotary
from vllm_omni_ascend_opt.blocks import targets as _targets
from vllm_omni_ascend_opt.optimization import PARALLEL_MODES, Optimization

#: Joint freqs kept (LRU): one per (vid, txt) freqs pair, i.e. per shape with ``rope``'s embedder memo.
JOINT_FREQS_CACHE_SIZE = 16
_OPMATH = {torch.float16: torch.float32, torch.bfloat16: torch.float32}
#: Devices where ``torch.rms_norm(x_opmath, (D,), None, eps)`` is the composite's pieces (CPU: checked bitwise against
#: them in tests/test_joint_attention.py; NPU: torch_npu 2.13 registers no rms_norm kernel, so the composite runs).
COMPOSITE_RMS_DEVICES = frozenset({"cpu", "npu"})


# ----------------------------------------------------------------------------------------------------------------
# the joint RMSNorm
# ----------------------------------------------------------------------------------------------------------------
def joint_rms_norm(x: torch.Tensor, st: int, w_txt: torch.Tensor, w_img: torch.Tensor, eps: float) -> torch.Tensor:
    """``cat([rms_norm(x[:, :st], w_txt), rms_norm(x[:, st:], w_img)], dim=1)``, bitwise, with one norm pass.

    Reproduces torch 2.13's ``rms_norm`` composite (what ``nn.RMSNorm`` runs on CPU and, op by op, on an NPU):
    upcast to the opmath type (fp32 for fp16/bf16), ``rsqrt(pow(x, 2).mean(-1, keepdim=True).add_(eps))``,
    ``x * rstd``, ``* weight`` in the promoted type, one cast back to ``x.dtype``. ``eps`` is applied as the opmath
    scalar, as the composite does."""
    dtype = x.dtype
    opmath = _OPMATH.get(dtype, dtype)
    xu = x.to(opmath)
    if x.device.type in COMPOSITE_RMS_DEVICES:
        # torch.rms_norm without weight on an opmath input: the same pieces run from C++ (no Python per piece)
        normed = torch.rms_norm(xu, (x.shape[-1],), None, eps)
    else:
        eps_t = _opmath_scalar(eps, opmath)
        rstd = torch.rsqrt(xu.pow(2).mean(-1, keepdim=True).add_(eps_t))
        normed = xu.mul(rstd)
    out_dtype = _promote(normed.dtype, w_txt.dtype)
    if out_dtype != _promote(normed.dtype, w_img.dtype):
        raise ValueError("the two norm weights promote to different dtypes")
    out = torch.empty(normed.shape, dtype=out_dtype, device=normed.device)
    torch.mul(normed[:, :st], w_txt, out=out[:, :st])
    torch.mul(normed[:, st:], w_img, out=out[:, st:])
    return out.to(dtype)


@functools.lru_cache(maxsize=64)
def _promote(a: torch.dtype, b: torch.dtype) -> torch.dtype:
    """``torch.promote_types`` memoized (it dispatches an aten op: kept off the counted hot path)."""
    return torch.promote_types(a, b)


@functools.lru_cache(maxsize=64)
def _opmath_scalar(eps: float, opmath: torch.dtype) -> float:
    """``eps`` rounded to the opmath type, as the composite's ``add_(eps)`` applies it."""
    return float(torch.tensor(eps, dtype=opmath))


def _plain_rms_norm(norm: nn.Module) -> str | None:
    """Why ``norm`` cannot take part in the joint norm (None when it can)."""
    if type(norm) not in rms_norm.RMS_NORM_CLASSES:
        return f"QK norm is {type(norm).__name__}, not nn.RMSNorm (qk_norm=False or another norm)"
    if "forward" in norm.__dict__ or norm._forward_hooks or norm._forward_pre_hooks:
        return "hooks or an instance forward on a QK norm"
    if norm._parameters.get("weight") is None:
        return "QK norm without weight (elementwise_affine=False)"
    if norm.eps is None:
        return "QK norm with eps=None (dtype-dependent eps)"
    return None


def static_reason(attn: nn.Module) -> str | None:
    """Why the joint path can never run for this ``QwenImageCrossAttention`` (None when it can), checked per call
    (the instance's modules; global module hooks once per forward)."""
    m = attn._modules
    norms = (m["norm_q"], m["norm_k"], m["norm_added_q"], m["norm_added_k"])
    for n in norms:
        why = _plain_rms_norm(n)
        if why:
            return why
    if norms[0].eps != norms[2].eps or norms[1].eps != norms[3].eps:
        return "the text and image QK norms use different eps"
    d = (attn.head_dim,)
    if any(n.normalized_shape != d for n in norms):
        return "a QK norm does not normalize over head_dim"
    if attn.query_num_heads != attn.add_query_num_heads or attn.kv_num_heads != attn.add_kv_num_heads:
        return "text and image projections have different head counts"
    if forward_scope.decide("guards.global_hooks", guards.global_hooks):
        return "global module hooks are registered"
    if not rope_tables.native_equivalent(m["rope"]):
        return "stock RoPE runs a device kernel (MindIE-SD/CUDA), not vLLM-Omni's native rotary math"
    return None


def _freqs_ok(freqs: torch.Tensor, seq: int, head_dim: int) -> bool:
    return freqs.dim() == 2 and freqs.is_complex() and freqs.shape[0] == seq and freqs.shape[-1] * 2 <= head_dim


# ----------------------------------------------------------------------------------------------------------------
# joint freqs, cached weakly on the (vid, txt) freqs pair
# ----------------------------------------------------------------------------------------------------------------
class _JointFreqsCache:
    """``cat(txt_freqs, vid_freqs)`` per (vid, txt) freqs pair, keyed like ``rope``'s tables
    (:func:`~vllm_omni_ascend_opt.blocks.rope_tables.table_key`).

    Policy: at most :data:`JOINT_FREQS_CACHE_SIZE` entries; a hit moves its entry to the most recent end, a new entry
    beyond the cap evicts the least recently used one; an entry dies with either freqs tensor."""

    def __init__(self, stats: Counter) -> None:
        self._entries: OrderedDict[tuple, tuple[weakref.ref, weakref.ref, torch.Tensor]] = OrderedDict()
        self._stats = stats

    def clear(self) -> None:
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, vid: torch.Tensor, txt: torch.Tensor) -> torch.Tensor:
        kv, rv = rope_tables.table_key(vid, vid.dtype)
        kt, rt = rope_tables.table_key(txt, txt.dtype)
        key = (kv, kt)
        hit = self._entries.get(key)
        if hit is not None and hit[0]() is rv and hit[1]() is rt:
            self._entries.move_to_end(key)
            self._stats["joint_freqs_hits"] += 1
            return hit[2]
        entries = self._entries

        def _drop(_ref: weakref.ref, key: tuple = key) -> None:
            entries.pop(key, None)

        joint = torch.cat([txt, vid], dim=0)
        self._stats["joint_freqs_builds"] += 1
        entries[key] = (weakref.ref(rv, _drop), weakref.ref(rt, _drop), joint)
        while len(entries) > JOINT_FREQS_CACHE_SIZE:
            entries.popitem(last=False)
        return joint


# ----------------------------------------------------------------------------------------------------------------
# the optimization
# ----------------------------------------------------------------------------------------------------------------
class JointAttention(Optimization):
    name = "joint_attention"
    summary = "Join the text and image streams once after their QKV projections; QK RMSNorms and RoPE run once on the joint sequence (bitwise stock)."
    equivalence = "exact"
    default_enabled = True
    requires = ("any device and dtype (stock's fused CUDA qk-norm-rope path stays stock)",)
    target_modules = (_targets.TRANSFORMER,)
    # The values handed to the attention layer are stock's (views of the joint tensors under SP); TP only changes
    # the local head counts (equal for both streams); CFG-parallel runs each branch as a single request.
    parallel_support = dict.fromkeys(PARALLEL_MODES, "supported")
    regions = frozenset({"block"})
    acts_without_attach = True
    #: What it replaces (the joint attention forward, qk-norm-rope) and mirrors (the native rotary math, stock's
    #: fused-CUDA branch condition, the QK norms' construction).
    upstream = (
        _targets.CROSS_ATTENTION_FORWARD,
        _targets.CROSS_ATTENTION_INIT,
        _targets.QK_NORM_ROPE,
        _targets.FUSED_MIN_TOKENS,
        _targets.FUSED_CUDA_SUPPORTED,
        _targets.ROTARY_FORWARD_NATIVE,
        _targets.ROTARY_FORWARD_NPU,
    )
    on_qwen_image_21 = "a single-stream transformer: there are no text and image streams to join"
    removal_plan = (
        "Drop when vLLM-Omni's QwenImageCrossAttention joins the two streams once and normalizes/rotates the joint "
        "sequence (or fuses qk-norm-rope on NPU)."
    )

    def __init__(self) -> None:
        super().__init__()
        self._joint_freqs = _JointFreqsCache(self.stats)
        self._tables = rope_tables.TableCache(self.stats)  # used when `rope` is not installed

    # ----- reporting -----------------------------------------------------------------------------------------
    def _process_reasons(self) -> list[str]:
        return []  # pure torch; runs wherever vLLM-Omni does

    def _model_reasons(self, model: nn.Module) -> list[str]:
        mod = sys.modules.get(_targets.TRANSFORMER)
        if mod is None:
            return ["vLLM-Omni's Qwen-Image transformer is not imported"]
        attns = [m for m in _modules(model) if isinstance(m, mod.QwenImageCrossAttention)]
        if not attns:
            return ["no QwenImageCrossAttention in this model"]
        reasons = [static_reason(a) for a in attns]
        return sorted({r for r in reasons if r}) if all(reasons) else []

    def notes(self) -> list[str]:
        s = self.stats
        out = [
            f"joint calls {s['joint_calls']} (qk_norm kernel {s['kernel_norm_calls']}), stock calls "
            f"{sum(self._fallbacks.values())}; joint freqs built {s['joint_freqs_builds']}, reused "
            f"{s['joint_freqs_hits']}"
        ]
        out += [f"stock ({n}x): {why}" for why, n in self._fallbacks.most_common()]
        return out

    # ----- install -------------------------------------------------------------------------------------------
    def _install(self) -> None:
        mod = sys.modules[_targets.TRANSFORMER]
        cls = mod.QwenImageCrossAttention
        self.patches.set(cls, "forward", self._make_forward(cls.forward))

    def _uninstall(self) -> None:
        self._joint_freqs.clear()
        self._tables.clear()

    def _attach(self, model: nn.Module) -> None:
        for tr in _transformers(model):
            forward_scope.watch(tr, self.name)  # per-forward decisions (guards, RoPE tables) once per forward

    def _detach(self, model: nn.Module) -> None:
        for tr in _transformers(model):
            forward_scope.unwatch(tr, self.name)

    # ----- the patched forward -------------------------------------------------------------------------------
    def _call_reason(
        self,
        attn: nn.Module,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        vid_freqs: Any,
        txt_freqs: Any,
    ) -> str | None:
        why = forward_scope.decide("ja.call_reason", _call_guard)  # once per forward; global hooks: static_reason
        if why:
            return why
        why = static_reason(attn)
        if why:
            return why
        if hidden_states.dim() != 3 or encoder_hidden_states.dim() != 3:
            return "hidden states are not [B, S, D]"
        if hidden_states.dtype != encoder_hidden_states.dtype:
            return "text and image hidden states differ in dtype"
        d = attn.head_dim
        if not isinstance(vid_freqs, torch.Tensor) or not isinstance(txt_freqs, torch.Tensor):
            return "freqs are not tensors"
        if not _freqs_ok(vid_freqs, hidden_states.shape[1], d) or not _freqs_ok(
            txt_freqs, encoder_hidden_states.shape[1], d
        ):
            return "RoPE freqs do not match the sequence lengths (complex [S, D/2] expected)"
        if vid_freqs.shape[-1] != txt_freqs.shape[-1] or vid_freqs.device != txt_freqs.device:
            return "text and image freqs differ in rotary dim or device"
        # decided before any projection runs: a fallback found after them would compute both QKV GEMMs twice; the
        # same for every block of a forward (its shapes, device and dtype), so decided once per forward
        key = ("ja.cuda_fused", attn.qk_norm, hidden_states.shape, encoder_hidden_states.shape, vid_freqs.shape, d)
        if forward_scope.decide(
            key, lambda: self._any_cuda_fused(attn, hidden_states, encoder_hidden_states, vid_freqs, txt_freqs, d)
        ):
            return "stock's fused CUDA qk-norm-rope path (>= its token threshold on CUDA)"
        return None

    def _any_cuda_fused(
        self,
        attn: nn.Module,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        vid_freqs: torch.Tensor,
        txt_freqs: torch.Tensor,
        d: int,
    ) -> bool:
        mod = sys.modules[_targets.TRANSFORMER]
        return bool(
            (attn.qk_norm and self._cuda_fused(mod, hidden_states, vid_freqs, d))
            or self._cuda_fused(mod, encoder_hidden_states, txt_freqs, d)
        )

    def _cuda_fused(self, mod: Any, x: torch.Tensor, freqs: torch.Tensor, head_dim: int) -> bool:
        """Whether stock's ``_qwen_image_qk_norm_rope`` would take its fused CUDA path for the stream whose hidden
        states are ``x`` (stock's own condition, in its order: token threshold, then ``_fused_cuda_supported``, which
        reads only q/k's device and dtype: those of ``x``, which the stream's QKV projection keeps)."""
        tokens = x.shape[0] * x.shape[1]
        return bool(
            tokens >= mod.fused_qk_norm_rope_min_tokens(mod._FUSED_MIN_TOKENS)
            and mod._fused_cuda_supported(x, x, head_dim, freqs.shape[-1] * 2, interleaved=True)
        )

    def _norm(self, x: torch.Tensor, st: int, norm_txt: nn.Module, norm_img: nn.Module) -> torch.Tensor:
        return joint_rms_norm(x, st, norm_txt.weight, norm_img.weight, norm_img.eps)

    def _rotation(
        self, x: torch.Tensor, vid_freqs: torch.Tensor, txt_freqs: torch.Tensor, rope: nn.Module
    ) -> Callable[[torch.Tensor], torch.Tensor]:
        """How q/k of this shape rotate in this forward: the joint freqs and their tables, looked up once per forward
        (the same freqs objects reach every block) and per shape class, then applied per call."""
        key = ("ja.rotation", id(vid_freqs), id(txt_freqs), x.dtype, x.device, x.shape)
        return forward_scope.decide(key, lambda: self._make_rotation(x, vid_freqs, txt_freqs, rope))

    def _make_rotation(
        self, x: torch.Tensor, vid_freqs: torch.Tensor, txt_freqs: torch.Tensor, rope: nn.Module
    ) -> Callable[[torch.Tensor], torch.Tensor]:
        joint_freqs = self._joint_freqs.get(vid_freqs, txt_freqs)
        kernel = rotary.active()  # switched on while `rope` is installed: its tables, verified kernel and counters
        if kernel is not None:
            return kernel.plan(x, joint_freqs, rope)
        tables = self._tables.get(joint_freqs, x.dtype)
        cos, sin_signed = rope_tables.portable_tables(tables, joint_freqs, self.stats)
        return functools.partial(rope_tables.apply_portable, cos=cos, sin_signed=sin_signed)

    def _make_forward(self, original: Callable[..., Any]) -> Callable[..., Any]:
        opt = self
        mod = sys.modules[_targets.TRANSFORMER]

        def forward(
            self: nn.Module,
            hidden_states: torch.Tensor,
            encoder_hidden_states: torch.Tensor,
            vid_freqs: torch.Tensor,
            txt_freqs: torch.Tensor,
            hidden_states_mask: torch.Tensor | None = None,
            encoder_hidden_states_mask: torch.Tensor | None = None,
        ) -> tuple[torch.Tensor, torch.Tensor]:
            if guards.tracing():  # first: dynamo traces stock code; nothing here is read, counted or logged
                return original(
                    self,
                    hidden_states,
                    encoder_hidden_states,
                    vid_freqs,
                    txt_freqs,
                    hidden_states_mask=hidden_states_mask,
                    encoder_hidden_states_mask=encoder_hidden_states_mask,
                )
            why = opt._call_reason(self, hidden_states, encoder_hidden_states, vid_freqs, txt_freqs)
            if why is None:
                out = opt._joint_forward(
                    mod,
                    self,
                    hidden_states,
                    encoder_hidden_states,
                    vid_freqs,
                    txt_freqs,
                    hidden_states_mask,
                    encoder_hidden_states_mask,
                )
                if isinstance(out, tuple):
                    return out
                why = out
            opt._fallback(why)
            return original(
                self,
                hidden_states,
                encoder_hidden_states,
                vid_freqs,
                txt_freqs,
                hidden_states_mask=hidden_states_mask,
                encoder_hidden_states_mask=encoder_hidden_states_mask,
            )

        forward.__wrapped__ = original  # type: ignore[attr-defined]
        forward.__doc__ = original.__doc__
        return forward

    def _joint_forward(
        self,
        mod: Any,
        attn: Any,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        vid_freqs: torch.Tensor,
        txt_freqs: torch.Tensor,
        hidden_states_mask: torch.Tensor | None,
        encoder_hidden_states_mask: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor] | str:
        """The joint path, or the reason it cannot run (the caller then runs stock)."""
        m = attn._modules
        img_qkv = self._project(m["to_qkv"], hidden_states, pair=True)
        txt_qkv = self._project(m["add_kv_proj"], encoder_hidden_states, pair=True)
        if (
            img_qkv.dtype != txt_qkv.dtype
            or img_qkv.shape[-1] != txt_qkv.shape[-1]
            or img_qkv.shape[0] != txt_qkv.shape[0]
            or img_qkv.device != txt_qkv.device
        ):
            return "text and image QKV projections differ in dtype, width, batch or device"
        d = attn.head_dim
        nq, nkv = attn.query_num_heads, attn.kv_num_heads
        q_size, kv_size = nq * d, nkv * d
        st = encoder_hidden_states.shape[1]
        norm_q, norm_k, norm_added_q, norm_added_k = m["norm_q"], m["norm_k"], m["norm_added_q"], m["norm_added_k"]
        if rms_norm.kernel_ready([norm_q, norm_k, norm_added_q, norm_added_k]):
            # qk_norm's npu_rms_norm takes gamma [D]: one kernel per stream (on stock's views), then one cat each for
            # q, k and v (v stays contiguous for the attention kernel). 9 launches with the joint rotary, against 11
            # in stock's order.
            img_q, img_k, img_v = (
                t.unflatten(-1, (n, d))
                for t, n in zip(img_qkv.split([q_size, kv_size, kv_size], dim=-1), (nq, nkv, nkv), strict=True)
            )
            txt_q, txt_k, txt_v = (
                t.unflatten(-1, (n, d))
                for t, n in zip(txt_qkv.split([q_size, kv_size, kv_size], dim=-1), (nq, nkv, nkv), strict=True)
            )
            query = torch.cat([norm_added_q(txt_q), norm_q(img_q)], dim=1)
            key = torch.cat([norm_added_k(txt_k), norm_k(img_k)], dim=1)
            value = torch.cat([txt_v, img_v], dim=1)
            self.stats["kernel_norm_calls"] += 1
        else:
            joint_qkv = torch.cat([txt_qkv, img_qkv], dim=1)
            query, key, value = joint_qkv.split([q_size, kv_size, kv_size], dim=-1)
            query = self._norm(query.unflatten(-1, (nq, d)), st, norm_added_q, norm_q)
            key = self._norm(key.unflatten(-1, (nkv, d)), st, norm_added_k, norm_k)
            value = value.unflatten(-1, (nkv, d))
        rope = m["rope"]
        query = self._rotation(query, vid_freqs, txt_freqs, rope)(query)
        key = self._rotation(key, vid_freqs, txt_freqs, rope)(key)
        self.stats["joint_calls"] += 1

        pc = attn.parallel_config
        if pc is not None and pc.sequence_parallel_size > 1 and not mod.get_forward_context().split_text_embed_in_sp:
            attn_metadata = mod.AttentionMetadata(
                joint_query=query[:, :st],
                joint_key=key[:, :st],
                joint_value=value[:, :st],
                joint_strategy="front",
            )
            if hidden_states_mask is not None:
                attn_metadata.attn_mask = hidden_states_mask
            if encoder_hidden_states_mask is not None:
                attn_metadata.joint_attn_mask = encoder_hidden_states_mask
            self.stats["sp_calls"] += 1
            joint_hidden_states = m["attn"](query[:, st:], key[:, st:], value[:, st:], attn_metadata)
        else:
            attn_metadata = None
            if hidden_states_mask is not None or encoder_hidden_states_mask is not None:
                txt_mask = encoder_hidden_states_mask
                if txt_mask is None:
                    txt_mask = torch.ones(
                        encoder_hidden_states.shape[:2], dtype=torch.bool, device=encoder_hidden_states.device
                    )
                img_mask = hidden_states_mask
                if img_mask is None:
                    img_mask = torch.ones(hidden_states.shape[:2], dtype=torch.bool, device=hidden_states.device)
                attn_metadata = mod.AttentionMetadata(attn_mask=torch.cat([txt_mask, img_mask], dim=1))
                self.stats["masked_calls"] += 1
            joint_hidden_states = m["attn"](query, key, value, attn_metadata)

        joint_hidden_states = joint_hidden_states.flatten(2, 3).to(query.dtype)
        img_attn_output = self._project(m["to_out"], joint_hidden_states[:, st:, :])
        txt_attn_output = self._project(m["to_add_out"], joint_hidden_states[:, :st, :])
        return img_attn_output, txt_attn_output

    def _project(self, layer: nn.Module, x: torch.Tensor, pair: bool = False) -> torch.Tensor:
        """``layer(x)`` (its output; ``pair``: the layer returns ``(output, bias)``): the GEMM directly when
        :func:`~vllm_omni_ascend_opt.blocks.direct_calls.linear_args` vouches for it (quantized, LoRA, TP and
        hooked layers are called as modules, the reason counted in :attr:`stats`)."""
        args = direct_calls.linear_args(layer)
        if isinstance(args, str):
            self.stats["module_calls"] += 1
            self.stats[f"module call: {args}"] += 1
            out = layer(x)
            return out[0] if pair else out
        self.stats["direct_calls"] += 1
        return direct_calls.linear(x, *args)


def _call_guard() -> str | None:
    return guards.call_reason(any_grad=True, hooks=False)


def _modules(model: Any) -> list[nn.Module]:
    return list(model.modules()) if isinstance(model, nn.Module) else []


def _transformers(model: Any) -> list[nn.Module]:
    mod = sys.modules.get(_targets.TRANSFORMER)
    if mod is None:
        return []
    return [m for m in _modules(model) if isinstance(m, mod.QwenImageTransformer2DModel)]


OPT = JointAttention()
