"""`memo_aware_offload`: layerwise offload leaves weights the memo makes unread on the host (:class:`MemoAwareOffload`).

Patches ``LayerwiseOffloadHook.pre_forward`` (block 0 decides per forward) and ``prefetch_layer`` (a skipping forward
leaves the modulation weights as the offloader's placeholders, which keep identity and version: the memo still hits).
"""

from __future__ import annotations

import sys
import weakref
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn as nn

from vllm_omni_ascend_opt._patching import PatchSet
from vllm_omni_ascend_opt.blocks.body.block_body import block_body_reason
from vllm_omni_ascend_opt.blocks.memo.cache import MEMO
from vllm_omni_ascend_opt.blocks.upstream import guards
from vllm_omni_ascend_opt.blocks.upstream.fingerprints import Upstream, same
from vllm_omni_ascend_opt.blocks.upstream.guards import find_transformers
from vllm_omni_ascend_opt.blocks.upstream.layerwise import LAYERWISE_MODULE, block_hook, is_modulation, layerwise_hooks
from vllm_omni_ascend_opt.optimization import Optimization

TENSOR_UTILS = "vllm_omni.diffusion.offloader.tensor_utils"
UPSTREAM: tuple[Upstream, ...] = (
    same(LAYERWISE_MODULE, "LayerwiseOffloadHook.pre_forward", "c8ff89a07c2c559a"),
    same(LAYERWISE_MODULE, "LayerwiseOffloadHook.prefetch_layer", "cdd013501e670e59"),
    same(LAYERWISE_MODULE, "LayerwiseOffloadHook.__init__", "80e9c3cad583e5b6"),
    same(LAYERWISE_MODULE, "LayerwiseOffloadHook.initialize_hook", "57e0f717ebc3134b"),
    same(TENSOR_UTILS, "set_tensor_storage", "7b23b08c46b1bca8"),
    same(TENSOR_UTILS, "make_offload_placeholder", "a3b97023cf5da1b4"),
)
NOT_ALL_MEMOIZED = "not every block's modulation is in the memo for this forward: every weight is copied"


@dataclass
class _Part:
    """One dtype of a block's host weights, without its modulation weights: what to copy and where it goes."""

    runs: list[tuple[int, int, int]]  # (host offset, device offset, numel) of each contiguous kept range
    kept: list[tuple[dict[str, Any], int]]  # (metadata, device offset) of each kept weight
    skipped: list[dict[str, Any]]  # metadata of each modulation weight
    numel: int  # kept elements

    @staticmethod
    def of(metadata: list[dict[str, Any]]) -> _Part:
        part = _Part([], [], [], 0)
        for meta in metadata:
            if is_modulation(meta["name"]):
                part.skipped.append(meta)
                continue
            part.kept.append((meta, part.numel))
            last = part.runs[-1] if part.runs else None
            if last is not None and last[0] + last[2] == meta["offset"] and last[1] + last[2] == part.numel:
                part.runs[-1] = (last[0], last[1], last[2] + meta["numel"])
            else:
                part.runs.append((meta["offset"], part.numel, meta["numel"]))
            part.numel += meta["numel"]
        return part


@dataclass
class _Ring:
    """One attached transformer's blocks and this forward's decision."""

    transformer: weakref.ReferenceType
    skip: bool = False
    probes_set: bool = False


class MemoAwareOffload(Optimization):
    name = "memo_aware_offload"
    summary = "Under layerwise offload, leave modulation weights the memo makes unread on the host (exact)."
    why = "Layerwise offload copies every block weight per forward, even img_mod/txt_mod that the memo leaves unread."
    how = (
        "In block 0's pre_forward, once per forward: skip when the memo holds every block's modulation for this "
        "temb (the lookup the blocks make) and the blocks run the memoizing forward (single-segment, not "
        "compiled). Prefetches of blocks 1..N-1 then copy all but the modulation weights (block 0 always whole); "
        "a block whose entry left the memo gets them copied before it runs, so no skipped weight is read: bitwise "
        "stock."
    )
    upstream_pr = "None. Upstream would let an offloaded module declare weights it can skip per forward."
    removal_plan = "Drop when vLLM-Omni's layerwise offload skips weights a forward does not read."
    equivalence = "exact"
    #: No patched region (it acts through the offload's hooks); it saves block weight copies of each forward.
    stages = frozenset({"denoise"})
    requires = ("vLLM-Omni 0.30.x with enable_layerwise_offload; any device",)
    inactive_when = (
        "the model is not offloaded layerwise (nothing is copied), shared_modulation does not act, the blocks are "
        "compiled or two-segment (zero_cond_t), or the memo misses for the forward (everything is copied then)"
    )
    target_modules = (LAYERWISE_MODULE,)
    needs = ("shared_modulation",)
    needs_config: ClassVar[dict[str, Any]] = {"enable_layerwise_offload": True}
    upstream = UPSTREAM
    on_qwen_image_21 = (
        "it asks shared_modulation's memo, which stays off there: upstream prepares one modulation for all blocks, "
        "no per-block img_mod/txt_mod weights to leave on the host"
    )
    no_patch_reason = (
        "upstream has no modulation memo to ask: a patch would stack on 0001-shared_modulation (every patch applies "
        "alone to pristine vLLM-Omni), and patches/check.py's exactness run loads the pipeline without layerwise "
        "offload, where it cannot act; to be written once the memo (0001) is upstream"
    )

    def __init__(self) -> None:
        super().__init__()
        self._rings: weakref.WeakKeyDictionary[nn.Module, tuple[_Ring, int]] = weakref.WeakKeyDictionary()
        self._parts: weakref.WeakKeyDictionary[Any, dict[torch.dtype, _Part]] = weakref.WeakKeyDictionary()
        self._probes: dict[int, PatchSet] = {}

    def _model_reasons(self, model: Any) -> list[str]:
        if not (transformers := find_transformers(model)):
            return ["no Qwen-Image transformer in this model"]
        reasons = []
        for tr in transformers:
            if not layerwise_hooks(tr):
                reasons.append(
                    "vLLM-Omni's layerwise offload is not enabled on this model (enable_layerwise_offload): no block "
                    "weights are copied per forward"
                )
            if why := self._static_reason(tr):
                reasons.append(why)
        return list(dict.fromkeys(reasons))

    @staticmethod
    def _static_reason(tr: nn.Module) -> str | None:
        """Why no forward of ``tr`` can skip, whatever the memo holds (None: forwards may skip)."""
        if any(getattr(b, "zero_cond_t", False) for b in tr.transformer_blocks):
            return "two-segment modulation (zero_cond_t): not covered, every weight is copied"
        if why := block_body_reason(tr):
            return why
        if "block" in guards.compiled_regions(tr):
            return "torch.compile runs the blocks: they read their modulation weights, every weight is copied"
        return None

    def notes(self) -> list[str]:
        s = self.stats
        return [
            f"forwards that skipped the modulation weights {s['forwards_skipping']}, that copied them "
            f"{s['forwards_copying']}; {s['bytes_skipped'] / 2**20:.1f} MiB left on the host, late copies "
            f"{s['late_copies']}"
        ]

    def _install(self) -> None:
        hook_cls = sys.modules[LAYERWISE_MODULE].LayerwiseOffloadHook
        original_pre, original_prefetch = hook_cls.pre_forward, hook_cls.prefetch_layer
        opt = self

        def pre_forward(self: Any, module: nn.Module, *args: Any, **kwargs: Any) -> tuple[tuple, dict]:
            if guards.tracing():  # first: stock, nothing read or counted while dynamo traces
                return original_pre(self, module, *args, **kwargs)
            ring = opt._before_block(module, args, kwargs)
            out = original_pre(self, module, *args, **kwargs)
            if ring is not None and ring.skip:
                opt._guarantee(self, module, args, kwargs)
            return out

        @torch.compiler.disable
        def prefetch_layer(self: Any, non_blocking: bool = True) -> None:
            parts = None if guards.tracing() else opt._skip_parts(self)
            if parts is None:
                return original_prefetch(self, non_blocking)
            return opt._prefetch_without_modulation(self, parts, non_blocking)

        pre_forward.__wrapped__ = original_pre  # type: ignore[attr-defined]
        prefetch_layer.__wrapped__ = original_prefetch  # type: ignore[attr-defined]
        self.patches.set(hook_cls, "pre_forward", pre_forward)
        self.patches.set(hook_cls, "prefetch_layer", prefetch_layer)

    def _uninstall(self) -> None:
        for ps in self._probes.values():
            ps.revert()
        self._probes.clear()
        self._parts = weakref.WeakKeyDictionary()

    def _attach(self, model: nn.Module) -> None:
        for tr in find_transformers(model):
            ring = _Ring(weakref.ref(tr))
            for i, block in enumerate(tr.transformer_blocks):
                self._rings[block] = (ring, i)

    def _detach(self, model: nn.Module) -> None:
        for tr in find_transformers(model):
            for block in tr.transformer_blocks:
                self._rings.pop(block, None)
            if (ps := self._probes.pop(id(tr), None)) is not None:
                ps.revert()

    @staticmethod
    def _temb(args: tuple, kwargs: dict[str, Any]) -> Any:
        """The block call's ``temb`` (keyword, or the block forward's 4th positional argument)."""
        return kwargs["temb"] if "temb" in kwargs else (args[3] if len(args) > 3 else None)

    def _before_block(self, module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> _Ring | None:
        """At block 0: decide for this forward (once). Returns the block's ring (None: not an attached block)."""
        ring, index = self._rings.get(module, (None, 0))
        if ring is None or index != 0:
            return ring
        ring.skip = False
        if (tr := ring.transformer()) is None:
            return None
        if why := self._forward_reason(tr, args, kwargs):
            self.stats["forwards_copying"] += 1
            self._fallback(why)
            return ring
        if not ring.probes_set:
            self._set_probes(tr)
            ring.probes_set = True
        ring.skip = True
        self.stats["forwards_skipping"] += 1
        return ring

    def _forward_reason(self, tr: nn.Module, args: tuple, kwargs: dict[str, Any]) -> str | None:
        """Why this forward must copy every weight (None: it may skip the modulation weights)."""
        if (memo := MEMO.get()) is None:
            return "shared_modulation is not installed"
        temb = self._temb(args, kwargs)
        if not isinstance(temb, torch.Tensor):
            return "the block call carries no temb tensor"
        if kwargs.get("modulate_index") is not None:
            return "two-segment modulation (modulate_index): not covered"
        if why := self._static_reason(tr):
            return why
        if not all(memo.has_block(b, temb) for b in tr.transformer_blocks):
            return NOT_ALL_MEMOIZED
        return None

    def _set_probes(self, tr: nn.Module) -> None:
        """Point each block hook's materialization probe (upstream: ``img_mod.1.weight``) at a weight always copied."""
        ps = self._probes.setdefault(id(tr), PatchSet(f"{self.name}:probes"))
        for block in tr.transformer_blocks:
            if (hook := block_hook(block)) is None:
                continue
            probe = getattr(hook, "_materialization_probe", None)
            if probe is None or not any(p is probe and is_modulation(n) for n, p in block.named_parameters()):
                continue
            other = next((p for n, p in block.named_parameters() if not is_modulation(n)), None)
            if other is not None:
                ps.set(hook, "_materialization_probe", other)

    def _guarantee(self, hook: Any, module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        """Before a block of a skipping forward runs: copy its modulation weights now if the memo no longer hits."""
        source = getattr(hook, "_prev_hook", None)  # the hook that prefetches this block
        if source is None or source.next_block is not module:
            return
        if all(p.numel() for n, p in source.next_block_parameters.items() if is_modulation(n)):
            return  # copied whole (block 0, or a forward that did not skip)
        if (memo := MEMO.get()) is not None and memo.has_block(module, self._temb(args, kwargs)):
            return
        self._fallback("a block's modulation left the memo after the per-forward decision: copied before it ran")
        self.stats["late_copies"] += 1
        self._copy_modulation(source)

    def _skip_parts(self, hook: Any) -> dict[torch.dtype, _Part] | None:
        """The kept / skipped weights of the block ``hook`` prefetches, when this forward skips (else None)."""
        ring, index = self._rings.get(hook.next_block, (None, 0))
        if ring is None or not ring.skip or index == 0:  # block 0 is prefetched for the next forward: always whole
            return None
        if hook not in self._parts:
            self._parts[hook] = {dtype: _Part.of(meta) for dtype, meta in hook.dtype_metadata.items()}
        return self._parts[hook]

    def _prefetch_without_modulation(self, hook: Any, parts: dict[torch.dtype, _Part], non_blocking: bool) -> None:
        """Upstream's ``prefetch_layer`` without the modulation weights (left as placeholders)."""
        tu = sys.modules[TENSOR_UTILS]
        platform = sys.modules[LAYERWISE_MODULE].current_omni_platform
        hook.copy_stream.wait_stream(platform.current_stream())
        evt = platform.Event()
        device_weights: dict[torch.dtype, torch.Tensor] = {}
        with platform.stream(hook.copy_stream):
            for dtype, host in hook.dtype_cpu_flattened_weights.items():
                part = parts[dtype]
                dev = torch.empty(part.numel, dtype=dtype, device=hook.device)
                for src, dst, n in part.runs:
                    dev[dst : dst + n].copy_(host[src : src + n], non_blocking=non_blocking)
                device_weights[dtype] = dev
            evt.record(hook.copy_stream)
        skipped = 0
        for dtype, part in parts.items():
            dev = device_weights[dtype]
            for meta, offset in part.kept:
                view = torch.as_strided(dev[offset : offset + meta["numel"]], size=meta["shape"], stride=meta["stride"])
                tu.set_tensor_storage(self._target(hook, meta["name"]), view)
            for meta in part.skipped:
                target = self._target(hook, meta["name"])
                tu.set_tensor_storage(target, tu.make_offload_placeholder(target))
                skipped += meta["numel"] * dev.element_size()
        hook._prefetch_done = evt
        self.stats["blocks_skipped"] += 1
        self.stats["bytes_skipped"] += skipped

    @staticmethod
    def _target(hook: Any, name: str) -> torch.Tensor:
        return hook.next_block_parameters[name] if name in hook.next_block_parameters else hook.next_block_buffers[name]

    def _copy_modulation(self, hook: Any) -> None:
        """The modulation weights of the block ``hook`` prefetches, copied host->device now (synchronously)."""
        tu = sys.modules[TENSOR_UTILS]
        for dtype, host in hook.dtype_cpu_flattened_weights.items():
            for meta in self._parts.get(hook, {}).get(dtype, _Part.of(hook.dtype_metadata[dtype])).skipped:
                dev = torch.empty(meta["numel"], dtype=dtype, device=hook.device)
                dev.copy_(host[meta["offset"] : meta["offset"] + meta["numel"]])
                view = torch.as_strided(dev, size=meta["shape"], stride=meta["stride"])
                tu.set_tensor_storage(self._target(hook, meta["name"]), view)


OPT = MemoAwareOffload()
