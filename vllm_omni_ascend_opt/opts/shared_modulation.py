"""`shared_modulation`: Compute SiLU(temb) and the per-block modulation projections once per distinct timestep embedding (exact memo), and unpack them once per block into broadcast-ready tensors.

Patched upstream symbols (``vllm_omni/diffusion/models/qwen_image/qwen_image_transformer.py``; vLLM-Omni 0.30.0, 0.31.0rc1, 0.32.0rc1)
---------------------------------------------------------------------------------------------------------------------------------------
* ``QwenImageTransformerBlock.forward`` (class attribute): the block reads its six modulation tensors from a memo.
* ``QwenImageTransformer2DModel.load_weights`` (class attribute): drops the memo after a (re)load.
* per attached transformer (``attach``): the ``img_mod``/``txt_mod`` ``nn.Sequential`` of every block and
  ``norm_out`` (diffusers' ``AdaLayerNormContinuous``) get a memoizing subclass (``__class__`` swap, same object,
  same state dict), so that direct calls such as TeaCache's block-0 probe ``block.img_mod(temb)`` and the final
  ``norm_out(h, temb)`` hit the memo too. ``detach``/``uninstall`` restore the classes by identity.

Why
  Per forward, stock computes SiLU(temb) 2x per block + once in ``norm_out`` and runs ``img_mod``/``txt_mod``
  (3072 -> 18432 each) in every block and ``norm_out.linear``: on real Qwen-Image 121 SiLUs and 121 GEMVs that read
  ~1/3 of all DiT weights, although they depend only on the timestep embedding ``temb``. ``1 + scale`` is
  recomputed four times per block from strided views.
How
  An exact memo (:class:`ModulationMemo` in ``blocks/memo/cache.py``, where its cache policies are listed;
  keys in ``blocks/memo/keys.py``; the block body in ``blocks/body/block_body.py``): the key is the *value* of
  ``temb`` (dtype, shape, device and a SHA-256 of its bytes, upstream's ``tensor_digest``), the numerical settings
  (matmul precision, autocast, grad mode, TF32/HF32 flags), and, per slot, the modules and their weights (object
  identity, ``_version``, shape, dtype, device -- not the storage, which vLLM-Omni's layerwise offload renews every
  forward; vLLM LoRA stacks and active-slice mask; quant method). The temb entry of a forward is found through the
  timestep: the swapped ``time_text_embed`` keys stock's temb by the timestep's value (B values read back, not temb's
  B x 3072) with the embedding's weights and keeps it, so a repeated timestep runs no embedding kernel and the blocks
  find the entry by temb's identity, no digest.
  A miss replays stock's computation
  (same ops, same inputs, one SiLU per distinct temb), so a hit is bitwise what stock would compute. Each block's
  modulation is stored unpacked ("decode broadcast"): contiguous ``(1 + scale, shift, gate)`` tensors ``[B, 1, D]``
  for its four norms, so a warm step runs no modulation op at all: ``LN(x) * (1 + scale) + shift`` and
  ``h + gate * y`` are the very elementwise ops stock runs, on the same values. Bounded by a byte budget
  (``VLLM_OMNI_ASCEND_OPT_MODULATION_CACHE_MB``, default 512; 0 disables), least-recently-used temb first.
  Costs: one device->host copy of the timestep (B values) per forward (of ``temb``, B x 3072 values, where the
  time embedding is not keyed); on a miss, 8 small copies per block to make the unpacked tensors contiguous. Every
  block finds the temb entry by the tensor's identity (no digest after the first lookup of a forward).
Two-segment modulation (Qwen-Image-Edit-2511, ``zero_cond_t``)
  Stock projects ``img_mod`` over ``temb = [emb(t); emb(0)]`` (2B rows) and, per image norm, builds three
  ``[B, L, D]`` tensors with ``torch.where(modulate_index, segment 1, segment 0)`` (``select01_modulation_native``, the
  stock path on NPU and CPU), then ``LN(x) * (1 + scale) + shift`` and ``gate * y`` over them. Here the block's
  modulation is memoized per temb value like the single-segment one, and the image stream uses per-segment
  broadcast (``blocks/body/two_segment.py``): :class:`SegmentPlan` reads ``modulate_index`` once per forward (its runs of
  equal values, one device->host copy); the sequence is viewed as ``[B, C, L/C, D]`` chunks (``C = L / gcd(run
  lengths)``, at most :data:`MAX_BROADCAST_CHUNKS`; the default edit request has C = 2) and multiplied by
  ``[B, C, 1, D]`` per-chunk
  ``(1 + scale, shift, gate)`` -- or, for more chunks, each run is computed on its slice with ``out=``. Each
  element sees the same IEEE mul/add on the same two values as in stock, so the result is bitwise stock's; the
  ``where``s, the bool casts and ``1 + scale`` over ``[B, L, D]`` disappear. The timestep-0 segment is kept once per
  block and weights signature for the model's life (reused while bitwise equal to the fresh rows of each missed
  projection; ``zero_t_*`` stats); with slice plans the memo entries of new timesteps then add only their own
  segment (broadcast plans keep small per-chunk copies of both).
Exactness and fallbacks
  While ``torch.compile`` traces, every patched forward checks :func:`blocks.upstream.guards.tracing` first and touches no
  memo, counter or logger. Under vLLM-Omni's regional compile the lookups run in eager pre-hooks of the compiled
  blocks, which receive the unpacked tensors ready (``blocks/body/compiled_blocks.py``) and run the body (with the fast
  tier's modes) inside their graphs; under full compile nothing eager runs between the blocks, so the compiled graph
  holds stock's modulation (reported as a reason). Otherwise it falls
  back to the stock code, with a reason (:meth:`SharedModulation.fallback_reasons`, debug log), under
  autograd (grad enabled and a tensor requiring grad), CUDA/NPU graph capture, global
  ``nn.Module`` forward hooks or hooks on the modules it would skip, inference-tensor weights (no version counter),
  unknown projection classes, and, for the edit models' two-segment blocks, the CUDA Triton select01 kernels (stock
  there), a ``modulate_index`` that differs between batch rows, and MindIE-SD's fused image norms (they take per-token
  tensors); those blocks still get their ``img_mod``/``txt_mod`` projections and ``norm_out`` from the memo on an
  attached model (a view of the last temb, such as ``temb.chunk(2)[0]``, is keyed by its geometry, not re-hashed).
  ``AdaLayerNorm`` is applied the way the instance dispatches
  (``forward_native``; ``forward_npu`` via ``torch_npu.npu_layer_norm_eval`` without MindIE-SD; with MindIE-SD the
  fused kernel takes ``scale``, so the memo keeps ``scale`` and calls the norm itself; likewise 0.32.0rc1's
  ``forward_cuda`` where its CUDA Triton AdaLN kernel exists, whose reductions are not ``F.layer_norm``'s: native only
  without it, ``ada_norm.native_forwards``; 0.32's own ``forward_musa`` is native). The mirrored upstream
  functions are fingerprinted per release (:data:`UPSTREAM`, source SHA-256, per platform for AdaLayerNorm's backend
  paths): upstream code that matches none of them turns the optimization off with a reason naming the function.
  Weights written in place through ``.data`` (``param.data.copy_``) bypass version counters: reloads through
  ``load_weights`` invalidate automatically, and so does the registry's weights-changed event (``nz_weights``'
  casts); anything else must call :meth:`SharedModulation.invalidate`.
Parallel
  The memo is per process (per rank) and runs no collective, so a hit on one rank and a miss on another cannot
  desynchronise anything; the modulation projections are ``ReplicatedLinear`` (identical on every TP rank), temb is
  replicated under Ulysses/ring SP, and each CFG-parallel rank memoizes its own branch.
Upstream PR
  none yet; upstream's ``ExactProjectionCache`` (vllm_omni/diffusion/cache/exact_projection_cache.py) implements the
  same idea for MiniMax-H3 only. Proposal: wire it into Qwen-Image's blocks with unpacked outputs.
Removal plan
  Drop this patch once vLLM-Omni memoizes Qwen-Image's modulation itself (its block forward's fingerprint then stops
  matching and it turns itself off). Upstream overlap: vllm-omni #7529 (open) reuses the projections across the serial
  CFG pair only.
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
from vllm_omni_ascend_opt.blocks.memo.cache import ENV_BUDGET_MB, ModulationMemo, budget_from_env
from vllm_omni_ascend_opt.blocks.memo.keys import (
    SELECT01_MODULE,
    unkeyable_reasons,
)
from vllm_omni_ascend_opt.blocks.upstream import ada_norm, forward_scope, guards
from vllm_omni_ascend_opt.blocks.upstream import targets as _targets
from vllm_omni_ascend_opt.blocks.upstream.fingerprints import ABSENT, V030, V031, V032, Upstream, same
from vllm_omni_ascend_opt.blocks.upstream.guards import find_transformers
from vllm_omni_ascend_opt.optimization import PARALLEL_MODES, Optimization

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
    summary = "Compute SiLU(temb) and the per-block modulation projections once per distinct timestep embedding (exact memo), and unpack them once per block into broadcast-ready tensors."
    equivalence = "exact"
    default_enabled = True
    requires = ("vLLM-Omni >= 0.30 whose code matches the fingerprints it knows; any device and dtype",)
    target_modules = (_targets.TRANSFORMER,)
    parallel_support = dict.fromkeys(PARALLEL_MODES, "supported")  # per-rank memo, no collectives (see docstring)
    regions = frozenset({"block", "transformer"})  # the block body and projections; norm_out in the forward
    #: Regional compile: the memo runs in eager (the transformer's forward and pre-hooks of the compiled blocks), the
    #: compiled blocks receive ready modulation tensors. Full compile traces the memo's lookups: stock code there.
    acts_compiled = frozenset({"regional"})
    removal_plan = "Drop once vLLM-Omni memoizes Qwen-Image's modulation (upstream ExactProjectionCache wiring)."
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

    def _hoist(self, block: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Eager pre-hook of a regionally compiled block: the memo lookup the compiled block cannot make, left on the
        block as ready tensors (None: the compiled block runs stock's code; the reason is counted)."""
        temb, hidden_states = kwargs.get("temb"), kwargs.get("hidden_states")
        hoisted = None
        if temb is not None and hidden_states is not None and kwargs.get("modulate_index") is None:
            mods = self._block_mods(block, temb, None, hidden_states)
            hoisted = hoistable(mods) if mods is not None else None
        compiled_blocks.set_ready(block, READY, hoisted)

    def hoisting(self, model: Any) -> bool:
        """``model``'s compiled blocks receive their modulation from the eager pre-hooks (regional compile)."""
        return any(self._hoister.active(tr) for tr in find_transformers(model))

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
