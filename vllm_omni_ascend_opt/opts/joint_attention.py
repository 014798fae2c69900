"""`joint_attention`: one join of Qwen-Image's text and image streams, bitwise stock (:class:`JointAttention`).

Patches ``QwenImageCrossAttention.forward``; the joint math is ``blocks/body/joint_qkv.py``, the rotation ``rope``'s
rotary service while installed, else the portable math. Under regional compile ``joint_qkv.traced_forward`` runs
with tables hoisted by an eager pre-hook; under full compile the graph keeps stock's attention.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

from vllm_omni_ascend_opt.blocks.body import compiled_blocks, direct_calls
from vllm_omni_ascend_opt.blocks.body.joint_qkv import (
    READY_ROPE,
    any_cuda_fused,
    attend,
    joint_qk_rms_norm,
    joint_rms_norm,
    qk_weights_fit,
    shape_reason,
    static_reason,
    traced_forward,
)
from vllm_omni_ascend_opt.blocks.body.joint_qkv import JointFreqsCache as _JointFreqsCache
from vllm_omni_ascend_opt.blocks.kernels import rms_norm, rope_tables, rotary
from vllm_omni_ascend_opt.blocks.upstream import forward_scope, guards
from vllm_omni_ascend_opt.blocks.upstream import targets as _targets
from vllm_omni_ascend_opt.optimization import Optimization


class JointAttention(Optimization):
    name = "joint_attention"
    summary = "Join text and image streams once; QK RMSNorms and RoPE run once on the joint sequence (bitwise stock)."
    why = (
        "Per block, stock runs four QK RMSNorms (6 to 8 kernels each on Ascend: torch_npu has no aten::rms_norm), "
        "four RoPE applications and three cats joining the two streams' q, k and v; batch-1 eager inference on an "
        "NPU is bound by kernel launches."
    )
    how = (
        "One cat of the text and image QKV projections (text first); q, k and v are views. The QK RMSNorms run "
        "once on the joint rows of q and k as one [2, B, S, N, D] tensor (fp32 opmath; only the weight multiply "
        "differs per stream), and RoPE once on the joint sequence, in place, with tables of cat(txt_freqs, "
        "vid_freqs) built once per freqs pair, in stock's op order: bitwise stock. Attention, mask, sequence "
        "parallelism and output projections stay stock's."
    )
    upstream_pr = "vllm-omni #7594 (open) does the same join on CUDA in one Triton launch; this is the portable form."
    removal_plan = "Drop when vLLM-Omni's joint attention joins the streams once (or fuses qk-norm-rope on NPU)."
    equivalence = "exact"
    requires = ("any device and dtype (stock's fused CUDA qk-norm-rope path stays stock)",)
    target_modules = (_targets.TRANSFORMER,)
    regions = frozenset({"block"})
    #: Under full compile the tables would be computed in the graph, slower than compiled stock: stock's attention.
    acts_compiled = frozenset({"regional"})
    acts_without_attach = True
    watches_forwards = True
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

    def __init__(self) -> None:
        super().__init__()
        self._joint_freqs = _JointFreqsCache(self.stats)
        self._tables = rope_tables.TableCache(self.stats)  # used when `rope` is not installed
        self._hoister = compiled_blocks.Hoister(self._hoist, (READY_ROPE,), submodule="attn")

    def cache_memory(self) -> dict[str, Any]:
        """The joint freqs cache (``cat(txt, vid)`` per freqs pair)."""
        return {"joint_freqs": len(self._joint_freqs), "bytes": self._joint_freqs.nbytes()}

    def _model_reasons(self, model: nn.Module) -> list[str]:
        if (mod := sys.modules.get(_targets.TRANSFORMER)) is None:
            return ["vLLM-Omni's Qwen-Image transformer is not imported"]
        modules = model.modules() if isinstance(model, nn.Module) else ()
        if not (attns := [m for m in modules if isinstance(m, mod.QwenImageCrossAttention)]):
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

    def _install(self) -> None:
        cls = sys.modules[_targets.TRANSFORMER].QwenImageCrossAttention
        self.patches.set(cls, "forward", self._make_forward(cls.forward))

    def _uninstall(self) -> None:
        self._hoister.release_all()
        self._joint_freqs.clear()
        self._tables.clear()

    def _call_reason(
        self,
        attn: nn.Module,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        vid_freqs: Any,
        txt_freqs: Any,
    ) -> str | None:
        """Why stock must run this call: the call guard once per forward, the instance and the inputs per call."""
        why = forward_scope.decide("ja.call_reason", guards.eager_call_reason)
        if why:
            return why
        why = static_reason(attn) or shape_reason(attn, hidden_states, encoder_hidden_states, vid_freqs, txt_freqs)
        if why:
            return why
        # before any projection runs (a later fallback would compute both QKV GEMMs twice); once per forward
        d = attn.head_dim
        key = ("ja.cuda_fused", attn.qk_norm, hidden_states.shape, encoder_hidden_states.shape, vid_freqs.shape, d)
        if forward_scope.decide(
            key, lambda: any_cuda_fused(attn, hidden_states, encoder_hidden_states, vid_freqs, txt_freqs)
        ):
            return "stock's fused CUDA qk-norm-rope path (>= its token threshold on CUDA)"
        return None

    def _joint_tables(
        self, vid_freqs: torch.Tensor, txt_freqs: torch.Tensor, dtype: torch.dtype, kernel: rotary.RotaryPath | None
    ) -> tuple[torch.Tensor, rope_tables.Tables]:
        """The joint freqs of (vid, txt) and their tables in ``dtype``, once per forward."""
        key = ("ja.tables", id(vid_freqs), id(txt_freqs), dtype, kernel is not None)

        def make() -> tuple[torch.Tensor, rope_tables.Tables]:
            joint = self._joint_freqs.joint(vid_freqs, txt_freqs)
            return joint, (kernel.tables if kernel is not None else self._tables).get(joint, dtype)

        return forward_scope.decide(key, make)

    def _rotate(
        self, x: torch.Tensor, vid_freqs: torch.Tensor, txt_freqs: torch.Tensor, rope: nn.Module, inplace: bool = False
    ) -> torch.Tensor:
        """``x`` (q, k, or both stacked) rotated by the joint freqs (``inplace``: ``x`` is this path's own)."""
        kernel = rotary.ROTARY.get()
        joint_freqs, tables = self._joint_tables(vid_freqs, txt_freqs, x.dtype, kernel)
        if kernel is not None:
            return kernel.apply(x, tables, joint_freqs, rope, inplace=inplace)
        cos, sin_signed = rope_tables.portable_tables(tables, joint_freqs, self.stats)
        return (rope_tables.apply_portable_ if inplace else rope_tables.apply_portable)(x, cos, sin_signed)

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
            streams = (hidden_states, encoder_hidden_states, vid_freqs, txt_freqs)
            masks = (hidden_states_mask, encoder_hidden_states_mask)
            if guards.tracing():  # first: dynamo traces; nothing here is counted, cached or logged
                if compiled_blocks.ready(self, READY_ROPE) is not None:
                    out = traced_forward(mod, self, *streams, *masks)
                    if out is not None:
                        return out
            else:
                why = opt._call_reason(self, *streams)
                if why is None:
                    out = opt._joint_forward(mod, self, streams, masks)
                    if isinstance(out, tuple):
                        return out
                    why = out
                opt._fallback(why)
            return original(
                self,
                *streams,
                hidden_states_mask=hidden_states_mask,
                encoder_hidden_states_mask=encoder_hidden_states_mask,
            )

        forward.__wrapped__ = original  # type: ignore[attr-defined]
        forward.__doc__ = original.__doc__
        return forward

    def _joint_forward(
        self, mod: Any, attn: Any, streams: tuple[torch.Tensor, ...], masks: tuple[torch.Tensor | None, ...]
    ) -> tuple[torch.Tensor, torch.Tensor] | str:
        """The joint path (eager twin of ``joint_qkv.traced_forward``), or the reason it cannot run."""
        hidden_states, encoder_hidden_states, vid_freqs, txt_freqs = streams
        m = attn._modules
        direct = direct_calls.decided()
        img_qkv = self._project(m["to_qkv"], hidden_states, direct, pair=True)
        txt_qkv = self._project(m["add_kv_proj"], encoder_hidden_states, direct, pair=True)
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
            # npu_rms_norm takes gamma [D]: one kernel per stream on stock's views, then one cat each for q, k, v
            sizes = [q_size, kv_size, kv_size]
            img_q, img_k, img_v = (t.unflatten(-1, (-1, d)) for t in img_qkv.split(sizes, dim=-1))
            txt_q, txt_k, txt_v = (t.unflatten(-1, (-1, d)) for t in txt_qkv.split(sizes, dim=-1))
            query = torch.cat([norm_added_q(txt_q), norm_q(img_q)], dim=1)
            key = torch.cat([norm_added_k(txt_k), norm_k(img_k)], dim=1)
            value = torch.cat([txt_v, img_v], dim=1)
            del img_qkv, txt_qkv, img_q, img_k, img_v, txt_q, txt_k, txt_v  # in the joint tensors now
            self.stats["kernel_norm_calls"] += 1
            query = self._rotate(query, vid_freqs, txt_freqs, m["rope"])
            key = self._rotate(key, vid_freqs, txt_freqs, m["rope"])
        else:
            qkv = torch.cat([txt_qkv, img_qkv], dim=1)
            # free the projections before the norms' fp32 temporaries (together they raise the peak above stock's)
            del img_qkv, txt_qkv
            b, s = qkv.shape[0], qkv.shape[1]
            value = qkv[..., q_size + kv_size :].view(b, s, nkv, d)
            w_txt, w_img = (norm_added_q.weight, norm_added_k.weight), (norm_q.weight, norm_k.weight)
            eps = norm_q.eps
            one_pass = nq == nkv and norm_k.eps == eps and qk_weights_fit(qkv.dtype, (*w_txt, *w_img))
            if one_pass and 2 * b * nq < rotary.KERNEL_BN_LIMIT:
                # q and k as one [2, B, S, N, D] tensor: one norm pass, one in-place rotation (within the B*N limit)
                qk = qkv[..., : q_size + kv_size].view(b, s, 2, nq, d).permute(2, 0, 1, 3, 4)
                qk = joint_qk_rms_norm(qk, st, w_txt, w_img, eps).flatten(0, 1)
                del qkv
                rotated = self._rotate(qk, vid_freqs, txt_freqs, m["rope"], inplace=True)
                query, key = rotated.view(2, b, s, nq, d).unbind(0)
                del qk, rotated
            else:
                query, key = qkv[..., : q_size + kv_size].split([q_size, kv_size], dim=-1)
                del qkv
                query = joint_rms_norm(query.unflatten(-1, (nq, d)), st, w_txt[0], w_img[0], eps)
                key = joint_rms_norm(key.unflatten(-1, (nkv, d)), st, w_txt[1], w_img[1], norm_k.eps)
                query = self._rotate(query, vid_freqs, txt_freqs, m["rope"])
                key = self._rotate(key, vid_freqs, txt_freqs, m["rope"])
        self.stats["joint_calls"] += 1

        joint_hidden_states = attend(
            mod, attn, query, key, value, st, hidden_states, encoder_hidden_states, *masks, self.stats
        )
        img_attn_output = self._project(m["to_out"], joint_hidden_states[:, st:, :], direct)
        txt_attn_output = self._project(m["to_add_out"], joint_hidden_states[:, :st, :], direct)
        return img_attn_output, txt_attn_output

    def _project(self, layer: nn.Module, x: torch.Tensor, direct: Any, pair: bool = False) -> torch.Tensor:
        """``layer(x)`` (``pair``: it returns ``(output, bias)``), as the GEMM where ``direct_calls`` vouches for it."""
        args = direct_calls.linear_args(layer, direct)
        if isinstance(args, str):
            self.stats["module_calls"] += 1
            self.stats[f"module call: {args}"] += 1
            out = layer(x)
            return out[0] if pair else out
        self.stats["direct_calls"] += 1
        return direct_calls.linear(x, *args)

    def _hoist(self, block: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Eager pre-hook of a regionally compiled block: this forward's joint RoPE tables, left on its attention."""
        attn = block._modules.get("attn")
        freqs, hidden_states = kwargs.get("image_rotary_emb"), kwargs.get("hidden_states")
        tables = None
        if attn is not None and isinstance(freqs, (tuple, list)) and len(freqs) == 2 and hidden_states is not None:
            vid, txt = freqs
            if isinstance(vid, torch.Tensor) and isinstance(txt, torch.Tensor) and vid.is_complex():
                joint_freqs, t = self._joint_tables(vid, txt, hidden_states.dtype, None)
                tables = rope_tables.portable_tables(t, joint_freqs, self.stats)
        if attn is not None:
            compiled_blocks.set_ready(attn, READY_ROPE, tables)


OPT = JointAttention()
