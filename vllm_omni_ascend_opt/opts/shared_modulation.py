"""`shared_modulation`: Qwen-Image's timestep-only modulation memoized, exactly (:class:`SharedModulation`).

Patches (``qwen_image_transformer.py``): ``QwenImageTransformerBlock.forward`` reads the block's unpacked modulation
from the memo (:class:`~vllm_omni_ascend_opt.blocks.memo.cache.ModulationMemo`; keys in ``blocks/memo/keys.py``, the
block body in ``blocks/body/``); ``QwenImageTransformer2DModel.load_weights`` drops the memo. Per attached
transformer the ``img_mod``/``txt_mod`` of every block, ``norm_out`` and ``time_text_embed`` get memoizing subclasses
(``__class__`` swap, same object and state dict), so direct calls such as TeaCache's ``block.img_mod(temb)`` probe hit
the memo too; ``detach`` restores the classes by identity.

Two-segment modulation (Qwen-Image-Edit-2511, ``zero_cond_t``): memoized per temb value like the single-segment one;
the image stream uses per-segment broadcast (``blocks/body/two_segment.py``), the same IEEE ops on the same values.

Under regional compile the lookups run in eager pre-hooks of the compiled blocks (``blocks/body/compiled_blocks.py``);
under full compile the graph holds stock's modulation (a reason). Stock code runs, with a counted reason, under
autograd, graph capture, global or modulation-module hooks, inference-tensor weights, MindIE-SD's fused image norms
and the CUDA Triton select01 kernels. The memo is per rank and runs no collective. Weights written through ``.data``
outside ``load_weights`` need :meth:`SharedModulation.invalidate` (or the registry's weights-changed event).
"""

from __future__ import annotations

import sys
import weakref
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
from vllm_omni_ascend_opt.blocks.memo.keys import (
    SELECT01_MODULE,
    unkeyable_reasons,
)
from vllm_omni_ascend_opt.blocks.upstream import ada_norm, forward_scope, guards
from vllm_omni_ascend_opt.blocks.upstream import targets as _targets
from vllm_omni_ascend_opt.blocks.upstream.fingerprints import ABSENT, V030, V031, V032, Upstream, same
from vllm_omni_ascend_opt.blocks.upstream.guards import find_transformers
from vllm_omni_ascend_opt.optimization import Optimization

_T, _ADA = _targets.TRANSFORMER, ada_norm.ADALAYERNORM_MODULE
#: The upstream functions this patch replaces (the block forward, load_weights) or mirrors (everything its memoized
#: block body and projections recompute), with the source fingerprints it knows (``blocks/upstream/fingerprints.py``). A function
#: whose source matches none of them turns it off with a reason: the exactness argument must be redone first.
#: AdaLayerNorm's per-backend paths are checked where vLLM-Omni dispatches to them; 0.32.0rc1's forward_cuda (the
#: CUDA Triton AdaLN kernel, whose reductions are not F.layer_norm's) is accepted because ``norm_kind`` treats it as
#: native only where that kernel is absent, and calls the instance (exact) otherwise.
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
    summary = (
        "Compute SiLU(temb) and the per-block modulation projections once per distinct timestep embedding (exact "
        "memo), and unpack them once per block into broadcast-ready tensors."
    )
    why = (
        "Per forward, stock computes SiLU(temb) twice per block and once in norm_out, and runs every block's "
        "img_mod/txt_mod projections (about a third of the DiT's weights) and norm_out.linear, although they "
        "depend only on the timestep embedding temb, which repeats across the CFG branches of a step and across "
        "requests with the same schedule; 1 + scale is recomputed four times per block from strided views."
    )
    how = (
        "An exact memo keyed on the value of temb (dtype, shape, device, SHA-256 of its bytes; found through the "
        "timestep's value by the time embedding, so a repeated timestep runs no embedding kernel), the numerical "
        "settings (grad mode, matmul precision, autocast, TF32/HF32) and each projection's weights (identity, "
        "version, shape, dtype, device, LoRA and quantization state). A miss replays stock's ops. Each block's "
        "modulation is stored unpacked as contiguous (1 + scale, shift, gate) [B, 1, D] tensors, so a warm step "
        "runs no modulation op and the block runs stock's elementwise ops on the same values: bitwise stock. "
        "AdaLayerNorm is applied the way the instance dispatches (the native path and npu_layer_norm_eval take "
        "the memoized 1 + scale; MindIE-SD and CUDA's Triton kernel are called as usual). Bounded by a byte "
        "budget, least recently used temb first; reloading the weights clears it."
    )
    upstream_pr = (
        "vllm-omni #7529 (open) reuses the modulation projections of the positive pass in the negative pass of "
        "serial CFG (a consume-once, block-local cache); this memo also hits across steps with equal timesteps, "
        "repeated requests and CFG-parallel ranks, and unpacks once per block: a textual conflict in the block "
        "forward. vllm-omni #7419 (open) fuses the block's residual and AdaLN pointwise stages on CUDA: a textual "
        "conflict, no semantic overlap. Upstream's ExactProjectionCache does the same for MiniMax-H3 only; "
        "proposal: wire it into Qwen-Image with unpacked outputs."
    )
    removal_plan = (
        "Drop once vLLM-Omni memoizes Qwen-Image's modulation itself: its block forward's fingerprint then stops "
        "matching and this turns itself off with a reason."
    )
    equivalence = "exact"
    requires = ("vLLM-Omni >= 0.30 whose code matches the fingerprints it knows; any device and dtype",)
    target_modules = (_targets.TRANSFORMER,)
    regions = frozenset({"block", "transformer"})  # the block body and projections; norm_out in the forward
    #: Regional compile: the memo runs in eager (the transformer's forward and pre-hooks of the compiled blocks), the
    #: compiled blocks receive ready modulation tensors. Full compile traces the memo's lookups: stock code there.
    acts_compiled = frozenset({"regional"})
    upstream = UPSTREAM
    on_qwen_image_21 = (
        "one modulation projection shared by all blocks, prepared once per step by upstream itself "
        "(prepared_modulation); no per-block img_mod/txt_mod to memoize"
    )

    def __init__(self) -> None:
        super().__init__()
        self.memo = ModulationMemo()
        self.stats = self.memo.stats  # the memo counts hits, misses, digests... for this optimization
        self._swapped: weakref.WeakKeyDictionary[nn.Module, type] = weakref.WeakKeyDictionary()
        self._classes: dict[str, type] = {}
        #: regional compile: eager pre-hooks that hand compiled blocks their modulation (blocks/body/compiled_blocks.py)
        self._hoister = compiled_blocks.Hoister(self._hoist, (READY,))

    # ----- reasons ----------------------------------------------------------------------------------------
    def _process_reasons(self) -> list[str]:
        reasons = []
        try:
            budget_from_env()
        except ValueError as exc:
            reasons.append(f"{ENV_BUDGET_MB} is invalid ({exc})")
        return reasons

    def _model_reasons(self, model: nn.Module) -> list[str]:
        transformers = find_transformers(model)
        if not transformers:
            return ["no Qwen-Image transformer in this model"]
        reasons = []
        if self.memo.max_bytes <= 0:
            reasons.append(f"modulation memo budget is 0 ({ENV_BUDGET_MB})")
        for tr in transformers:
            # The very checks the memo makes per call (keyability of every projection), not a guess from the
            # weights between forwards (under layerwise offload they are placeholders then).
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
            # Qwen-Image-Edit-2511's timestep-0 segments: kept outside the budget (one per block and weights)
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
        """Drop every memoized tensor: call after writing modulation weights in a way version counters cannot see
        (``param.data`` writes other than ``load_weights``, which invalidates by itself)."""
        self.memo.clear()

    def weights_changed(self, model: Any = None) -> None:
        """Another optimization rewrote weights behind the version counters (``nz_weights``): drop the memo."""
        self.invalidate()

    # ----- install ----------------------------------------------------------------------------------------
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
            mods = None
            if not guards.tracing():  # first: under dynamo nothing mutable is read, the graph holds stock's block
                mods = opt._block_mods(self, temb, modulate_index, hidden_states)
            elif modulate_index is None:
                hoisted = compiled_blocks.ready(self, READY)  # regional compile: looked up by the eager pre-hook
                if hoisted is not None:
                    return traced_block_body(
                        self,
                        hoisted,
                        hidden_states,
                        encoder_hidden_states,
                        encoder_hidden_states_mask,
                        image_rotary_emb,
                        hidden_states_mask,
                    )
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
            return block_body(
                self,
                mods,
                hidden_states,
                encoder_hidden_states,
                encoder_hidden_states_mask,
                image_rotary_emb,
                hidden_states_mask,
                opt.stats,
            )

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
        """Eager pre-hook of a regionally compiled block: the memo lookup the compiled block cannot make, left on the
        block as ready tensors (None: the compiled block runs stock's code; the reason is counted)."""
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
            mods, why = self.memo.block_two_segment(block, temb, modulate_index, hidden_states)
        elif modulate_index is not None or block.zero_cond_t:
            mods, why = None, "zero_cond_t and modulate_index disagree (stock decides)"
        else:
            mods, why = self.memo.block(block, temb)
        if mods is None:
            self._fallback(why or "unknown")
        return mods

    def _make_classes(self, t: Any) -> None:
        if self._classes:
            return
        opt = self
        base_norm = t.AdaLayerNormContinuous
        stock_norm_out = base_norm.forward

        class MemoModulation(nn.Sequential):
            """Stock ``nn.Sequential(SiLU, ReplicatedLinear)`` whose direct calls are memoized (same object)."""

            def forward(self, input: torch.Tensor) -> torch.Tensor:
                if not guards.tracing():  # first: under dynamo, stock's Sequential and nothing else
                    out, why = opt.memo.direct_projection(self, input)
                    if out is not None:
                        return out
                    opt._fallback(why or "unknown")
                return nn.Sequential.forward(self, input)

        class MemoAdaLayerNormContinuous(base_norm):
            """diffusers' AdaLayerNormContinuous whose ``(1 + scale, shift)`` come from the memo (same object)."""

            def forward(self, x: torch.Tensor, conditioning_embedding: torch.Tensor) -> torch.Tensor:
                if not guards.tracing():  # first: under dynamo, stock's forward and nothing else
                    mods, why = opt.memo.norm_out(self, x, conditioning_embedding)
                    if mods is not None:
                        ops, shift = mods
                        return self.norm(x) * ops + shift
                    opt._fallback(why or "unknown")
                return stock_norm_out(self, x, conditioning_embedding)

        base_time = t.QwenTimestepProjEmbeddings
        stock_time = base_time.forward

        class MemoTimeEmbedding(base_time):
            """vLLM-Omni's QwenTimestepProjEmbeddings whose output (stock's) is keyed in the memo by the timestep's
            value, so that the blocks find their entry without a digest of temb (same object, same state dict)."""

            def forward(
                self, timestep: torch.Tensor, hidden_states: torch.Tensor, addition_t_cond: Any = None
            ) -> torch.Tensor:
                if not guards.tracing():  # first: under dynamo, stock's time embedding and nothing else
                    temb, why = opt.memo.time_embedding(self, timestep, hidden_states, addition_t_cond, stock_time)
                    if temb is not None:
                        return temb
                    opt._fallback(why or "unknown")
                return stock_time(self, timestep, hidden_states, addition_t_cond)

        self._classes = {
            "modulation": MemoModulation,
            "norm_out": MemoAdaLayerNormContinuous,
            "norm_base": base_norm,
            "time": MemoTimeEmbedding,
            "time_base": base_time,
        }

    def _uninstall(self) -> None:
        MEMO.withdraw(self.memo)
        self._hoister.release_all()
        for module, cls in list(self._swapped.items()):
            module.__class__ = cls
        self._swapped = weakref.WeakKeyDictionary()
        self.memo.clear()

    # ----- attach -----------------------------------------------------------------------------------------
    def _attach(self, model: nn.Module) -> None:
        for tr in find_transformers(model):
            # a scope per forward (the body's direct calls decide once per forward); hooks once its blocks are compiled
            forward_scope.watch(tr, self.name, on_forward=self._hoister.on_forward)
            for block in tr.transformer_blocks:
                for name in ("img_mod", "txt_mod"):
                    self._swap(getattr(block, name), nn.Sequential, self._classes["modulation"])
            self._swap(tr.norm_out, self._classes["norm_base"], self._classes["norm_out"])
            self._swap(tr.time_text_embed, self._classes["time_base"], self._classes["time"])

    def _detach(self, model: nn.Module) -> None:
        for tr in find_transformers(model):
            forward_scope.unwatch(tr, self.name)
            self._hoister.release(tr)
            parts = [getattr(b, n) for b in tr.transformer_blocks for n in ("img_mod", "txt_mod")]
            for m in [*parts, tr.norm_out, tr.time_text_embed]:
                cls = self._swapped.pop(m, None)
                if cls is not None:
                    m.__class__ = cls
        self.memo.clear()

    def _swap(self, module: nn.Module, expected: type, replacement: type) -> None:
        if type(module) is expected and module not in self._swapped:
            self._swapped[module] = expected
            module.__class__ = replacement

    def is_prepared(self, module: nn.Module) -> bool:
        """Whether ``module`` (an img_mod/txt_mod/norm_out) currently carries the memoizing class."""
        return module in self._swapped


OPT = SharedModulation()
