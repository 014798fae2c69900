"""`shared_modulation`: Qwen-Image's timestep-only modulation memoized, exactly (:class:`SharedModulation`).

Patches ``QwenImageTransformerBlock.forward`` and ``load_weights`` (drops the memo). Per attached transformer, each
block's ``img_mod``/``txt_mod``, ``norm_out`` and ``time_text_embed`` get memoizing subclasses (``__class__`` swap),
so direct calls such as TeaCache's ``block.img_mod(temb)`` hit the memo too. Weights written through ``.data``
outside ``load_weights`` need :meth:`SharedModulation.invalidate` (or the registry's weights-changed event).
"""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.nn as nn

from vllm_omni_ascend_opt.blocks.body import compiled_blocks
from vllm_omni_ascend_opt.blocks.body.block_body import (
    READY,
    block_body,
    block_body_reason,
    hoistable,
    traced_block_body,
)
from vllm_omni_ascend_opt.blocks.memo.cache import ENV_BUDGET_MB, MEMO, ModulationMemo, budget_from_env
from vllm_omni_ascend_opt.blocks.memo.keys import SELECT01_MODULE, unkeyable_reasons
from vllm_omni_ascend_opt.blocks.upstream import ada_norm, guards
from vllm_omni_ascend_opt.blocks.upstream import targets as _targets
from vllm_omni_ascend_opt.blocks.upstream.fingerprints import ABSENT, V030, V031, V032, Upstream, same
from vllm_omni_ascend_opt.blocks.upstream.guards import find_transformers
from vllm_omni_ascend_opt.optimization import Optimization

_T, _ADA = _targets.TRANSFORMER, ada_norm.ADALAYERNORM_MODULE
UPSTREAM: tuple[Upstream, ...] = (
    _targets.BLOCK_FORWARD,
    same(_T, "QwenImageTransformerBlock._modulate", "790253f78c1c2199"),
    same(_T, "ModulateIndexPrepare.forward", "b4795fc261a07196"),
    same(_T, "QwenImageTransformer2DModel.load_weights", "97bb5a17d9d284e8"),
    _targets.ADA_FORWARD_NATIVE,
    Upstream(
        _ADA, "AdaLayerNorm.forward_cuda", {"22177f92ea028df7": (V030, V031), "a461e2192f4bb1eb": (V032,)}, ("cuda",)
    ),
    same(_ADA, "AdaLayerNorm.forward_hip", "f9d2d32dd4f4243a", ("rocm",)),
    _targets.ADA_FORWARD_NPU,
    Upstream(_ADA, "AdaLayerNorm.forward_musa", {ABSENT: (V030, V031), "5ea15656b97250d9": (V032,)}, ("musa",)),
    same(_ADA, "AdaLayerNorm.__init__", "949821cb9b9f61e5"),
    same(ada_norm.CUSTOM_OP_MODULE, "CustomOp.forward", "2b37fcf479cd9ace"),
    same(ada_norm.CUSTOM_OP_MODULE, "CustomOp.dispatch_forward", "0e7d8d55ef65c2ab"),
    same("diffusers.models.normalization", "AdaLayerNormContinuous.forward", "9cc655ba4fb2bfec"),
    same(SELECT01_MODULE, "split_select01_mod_params", "e8a80c7ad2a79e31"),
    same(SELECT01_MODULE, "select01_modulation_native", "3f26039abc062cb2"),
    same("vllm_omni.diffusion.cache.exact_projection_cache", "tensor_digest", "2d06cf9827d786a9"),
)


class SharedModulation(Optimization):
    name = "shared_modulation"
    summary = "Memoize the blocks' modulation projections per distinct timestep embedding (exact), unpacked per block."
    why = (
        "Per forward, stock computes SiLU(temb) in every block and in norm_out and runs every block's "
        "img_mod/txt_mod projections (about a third of the DiT's weights) and norm_out.linear, although they "
        "depend only on temb, which repeats across a step's CFG branches and across requests with the same "
        "schedule."
    )
    how = (
        "An exact memo keyed on the value of temb (SHA-256 of its bytes; found through the timestep's value, so a "
        "repeated timestep runs no embedding kernel), the numerical settings and each projection's weights "
        "(identity, version, LoRA and quantization state); a miss replays stock's ops. Each block's modulation is "
        "stored unpacked as contiguous (1 + scale, shift, gate) [B, 1, D] tensors: a warm step runs no modulation "
        "op and the block runs stock's elementwise ops on the same values, bitwise stock. Bounded by a byte "
        "budget (LRU); reloading the weights clears it."
    )
    upstream_pr = (
        "vllm-omni #7529 (open) reuses the positive pass's modulation projections in serial CFG's negative pass; "
        "this memo also hits across steps, requests and CFG-parallel ranks: a textual conflict in the block "
        "forward, as with vllm-omni #7419 (open, CUDA AdaLN fusion). Upstream's ExactProjectionCache does this "
        "for MiniMax-H3 only; proposal: wire it into Qwen-Image."
    )
    removal_plan = "Drop once vLLM-Omni memoizes Qwen-Image's modulation itself (the fingerprints then turn this off)."
    equivalence = "exact"
    requires = ("vLLM-Omni >= 0.30 whose code matches the fingerprints it knows; any device and dtype",)
    target_modules = (_targets.TRANSFORMER,)
    regions = frozenset({"block", "transformer"})  # the block body and projections; norm_out in the forward
    #: Regional compile: the lookups run in eager, the compiled blocks get ready tensors; full compile: stock.
    acts_compiled = frozenset({"regional"})
    watches_forwards = True
    upstream = UPSTREAM
    on_qwen_image_21 = (
        "one modulation projection shared by all blocks, prepared once per step by upstream itself "
        "(prepared_modulation); no per-block img_mod/txt_mod to memoize"
    )

    def __init__(self) -> None:
        super().__init__()
        self.memo = ModulationMemo()
        self.stats = self.memo.stats
        self._classes: dict[str, tuple[type, type]] = {}
        self._hoister = compiled_blocks.Hoister(self._hoist, (READY,))

    def _process_reasons(self) -> list[str]:
        try:
            budget_from_env()
        except ValueError as exc:
            return [f"{ENV_BUDGET_MB} is invalid ({exc})"]
        return []

    def _model_reasons(self, model: nn.Module) -> list[str]:
        if not (transformers := find_transformers(model)):
            return ["no Qwen-Image transformer in this model"]
        reasons = [f"modulation memo budget is 0 ({ENV_BUDGET_MB})"] if self.memo.max_bytes <= 0 else []
        for tr in transformers:
            # the memo's per-call checks, not the weights between forwards (placeholders under layerwise offload)
            reasons += unkeyable_reasons(tr)
        return list(dict.fromkeys(reasons))

    def model_notes(self, model: nn.Module) -> list[str]:
        return [why for tr in find_transformers(model) if (why := block_body_reason(tr))]

    def cache_memory(self) -> dict[str, Any]:
        return {
            "bytes": int(self.memo.nbytes),
            "budget_bytes": int(self.memo.max_bytes),
            "entries": len(self.memo),
            "evictions": int(self.memo.stats.get("evictions", 0)),
            # the edit models' timestep-0 segments, outside the budget
            "zero_t_segments": len(self.memo._zero_t),
            "zero_t_bytes": int(self.memo.zero_t_nbytes),
        }

    def notes(self) -> list[str]:
        s = self.memo.stats
        return [
            f"memo budget {self.memo.max_bytes / 1024**2:.0f} MiB ({ENV_BUDGET_MB}); "
            f"{len(self.memo)} temb entries, {self.memo.nbytes / 1024**2:.1f} MiB; "
            f"hits {s['hits']}, misses {s['misses']}, evictions {s['evictions']}"
        ]

    def invalidate(self) -> None:
        """Drop the memo: call after writing modulation weights behind the version counters (``param.data``)."""
        self.memo.clear()

    def weights_changed(self, model: Any = None) -> None:
        """Another optimization rewrote weights behind the version counters (``nz_weights``): drop the memo."""
        self.invalidate()

    def _install(self) -> None:
        t = sys.modules[_targets.TRANSFORMER]
        block_cls, model_cls = t.QwenImageTransformerBlock, t.QwenImageTransformer2DModel
        self.memo.configure(budget_from_env())
        self._make_classes(t)
        original_forward = block_cls.forward
        opt = self

        def forward(
            self,
            hidden_states: torch.Tensor,
            encoder_hidden_states: torch.Tensor,
            encoder_hidden_states_mask: torch.Tensor,
            temb: torch.Tensor,
            image_rotary_emb: tuple[torch.Tensor, torch.Tensor],
            joint_attention_kwargs: dict[str, Any] | None = None,
            modulate_index: list[int] | None = None,
            hidden_states_mask: torch.Tensor | None = None,
        ) -> tuple[torch.Tensor, torch.Tensor]:
            streams = (hidden_states, encoder_hidden_states, encoder_hidden_states_mask, image_rotary_emb)
            mods = None
            if not guards.tracing():  # first: under dynamo nothing mutable is read, the graph holds stock's block
                mods = opt._block_mods(self, temb, modulate_index, hidden_states)
            elif modulate_index is None:
                hoisted = compiled_blocks.ready(self, READY)  # regional compile: looked up by the eager pre-hook
                if hoisted is not None:
                    return traced_block_body(self, hoisted, *streams, hidden_states_mask)
            if mods is None:
                return original_forward(
                    self,
                    hidden_states=hidden_states,
                    encoder_hidden_states=encoder_hidden_states,
                    encoder_hidden_states_mask=encoder_hidden_states_mask,
                    temb=temb,
                    image_rotary_emb=image_rotary_emb,
                    joint_attention_kwargs=joint_attention_kwargs,
                    modulate_index=modulate_index,
                    hidden_states_mask=hidden_states_mask,
                )
            return block_body(self, mods, *streams, hidden_states_mask, opt.stats)

        forward.__wrapped__ = original_forward  # type: ignore[attr-defined]
        forward.__doc__ = original_forward.__doc__
        self.patches.set(block_cls, "forward", forward)

        original_load = model_cls.load_weights

        def load_weights(self, weights):
            try:
                return original_load(self, weights)
            finally:
                opt.invalidate()  # default_weight_loader writes through param.data: version counters miss it

        load_weights.__wrapped__ = original_load  # type: ignore[attr-defined]
        self.patches.set(model_cls, "load_weights", load_weights)
        MEMO.provide(self.memo)

    def _hoist(self, block: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Eager pre-hook of a regionally compiled block: its memo lookup, left on the block (None: stock runs)."""
        temb, hidden_states = kwargs.get("temb"), kwargs.get("hidden_states")
        hoisted = None
        if temb is not None and hidden_states is not None and kwargs.get("modulate_index") is None:
            mods = self._block_mods(block, temb, None, hidden_states)
            hoisted = hoistable(mods) if mods is not None else None
        compiled_blocks.set_ready(block, READY, hoisted)

    def _block_mods(
        self, block: nn.Module, temb: torch.Tensor, modulate_index: Any, hidden_states: torch.Tensor
    ) -> tuple[Any, ...] | None:
        """The block's unpacked modulation from the memo, or None (the reason counted) when stock must run."""
        if modulate_index is not None and block.zero_cond_t:
            return self._hit(self.memo.block_two_segment(block, temb, modulate_index, hidden_states))
        if modulate_index is not None or block.zero_cond_t:
            return self._hit((None, "zero_cond_t and modulate_index disagree (stock decides)"))
        return self._hit(self.memo.block(block, temb))

    def _hit(self, found: tuple[Any, str | None]) -> Any:
        """The memo's answer, or None with the reason it gave counted."""
        out, why = found
        if out is None:
            self._fallback(why or "unknown")
        return out

    def _make_classes(self, t: Any) -> None:
        if self._classes:
            return
        opt = self
        base_norm, base_time = t.AdaLayerNormContinuous, t.QwenTimestepProjEmbeddings
        stock_norm_out, stock_time = base_norm.forward, base_time.forward

        class MemoModulation(nn.Sequential):
            """Stock ``nn.Sequential(SiLU, ReplicatedLinear)`` whose direct calls are memoized (same object)."""

            def forward(self, input: torch.Tensor) -> torch.Tensor:
                if not guards.tracing():  # first: under dynamo, stock's Sequential and nothing else
                    out = opt._hit(opt.memo.direct_projection(self, input))
                    if out is not None:
                        return out
                return nn.Sequential.forward(self, input)

        class MemoAdaLayerNormContinuous(base_norm):
            """diffusers' AdaLayerNormContinuous whose ``(1 + scale, shift)`` come from the memo (same object)."""

            def forward(self, x: torch.Tensor, conditioning_embedding: torch.Tensor) -> torch.Tensor:
                if not guards.tracing():  # first: under dynamo, stock's forward and nothing else
                    mods = opt._hit(opt.memo.norm_out(self, x, conditioning_embedding))
                    if mods is not None:
                        ops, shift = mods
                        return self.norm(x) * ops + shift
                return stock_norm_out(self, x, conditioning_embedding)

        class MemoTimeEmbedding(base_time):
            """QwenTimestepProjEmbeddings whose output the memo keys by the timestep's value (same object)."""

            def forward(
                self, timestep: torch.Tensor, hidden_states: torch.Tensor, addition_t_cond: Any = None
            ) -> torch.Tensor:
                if not guards.tracing():  # first: under dynamo, stock's time embedding and nothing else
                    temb = opt._hit(opt.memo.time_embedding(self, timestep, hidden_states, addition_t_cond, stock_time))
                    if temb is not None:
                        return temb
                return stock_time(self, timestep, hidden_states, addition_t_cond)

        self._classes = {
            "modulation": (nn.Sequential, MemoModulation),
            "norm_out": (base_norm, MemoAdaLayerNormContinuous),
            "time": (base_time, MemoTimeEmbedding),
        }

    def _uninstall(self) -> None:
        MEMO.withdraw(self.memo)
        self._hoister.release_all()
        self.memo.clear()

    @staticmethod
    def _swappable(tr: nn.Module) -> list[tuple[nn.Module, str]]:
        """The transformer's modules that get a memoizing class, with their kind (a key of ``_classes``)."""
        mods = [(getattr(b, n), "modulation") for b in tr.transformer_blocks for n in ("img_mod", "txt_mod")]
        return [*mods, (tr.norm_out, "norm_out"), (tr.time_text_embed, "time")]

    def _attach(self, model: nn.Module) -> None:
        for tr in find_transformers(model):
            for m, kind in self._swappable(tr):
                self._swap_class(m, *self._classes[kind])

    def _detach(self, model: nn.Module) -> None:
        for tr in find_transformers(model):
            for m, _ in self._swappable(tr):
                self._restore_class(m)
        self.memo.clear()


OPT = SharedModulation()
