"""The modulation memo: an exact, byte-bounded LRU of Qwen-Image's modulation tensors (``shared_modulation`` owns
one). Each rule is pinned by a test in tests/test_shared_modulation.py and a named mutation.

* Key: temb's value (SHA-256 of its bytes; a view of the last digested temb by its geometry) and the numerical
  settings; per slot (block, direct projection, ``norm_out``) the module and its weight signature (:mod:`.keys`).
* LRU: a hit or new slot moves its entry to the most recent end; eviction never takes the entry being filled.
* Budget (``VLLM_OMNI_ASCEND_OPT_MODULATION_CACHE_MB``, default 512 MiB; 0 disables) bounds SiLU(temb) and every
  payload; what cannot fit is not stored. Timestep-0 segments (two-segment blocks) sit outside it.
"""

from __future__ import annotations

import os
import sys
import weakref
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from vllm_omni_ascend_opt import _env
from vllm_omni_ascend_opt.blocks.body.block_body import NormMod
from vllm_omni_ascend_opt.blocks.body.two_segment import SegmentPlan, SegMod
from vllm_omni_ascend_opt.blocks.memo import keys, time_embedding
from vllm_omni_ascend_opt.blocks.memo.keys import Span, Unkeyable
from vllm_omni_ascend_opt.blocks.slots import Slot
from vllm_omni_ascend_opt.blocks.upstream import ada_norm, guards, targets
from vllm_omni_ascend_opt.blocks.weak_lru import tensor_bytes

ENV_BUDGET_MB = "VLLM_OMNI_ASCEND_OPT_MODULATION_CACHE_MB"
DEFAULT_BUDGET_MB = 512


def budget_from_env() -> int:
    """The memo's byte budget from ``VLLM_OMNI_ASCEND_OPT_MODULATION_CACHE_MB`` (MiB, default 512)."""
    raw = os.environ.get(ENV_BUDGET_MB, "").strip()
    mb = float(raw or DEFAULT_BUDGET_MB)  # ValueError for junk: reasons_inactive() reports it
    if not 0 <= mb < float("inf"):  # NaN too
        raise ValueError(f"{ENV_BUDGET_MB}={raw!r} must be a non-negative number of MiB")
    _env.check_range(ENV_BUDGET_MB, mb, 0, 16384, " MiB")  # above 16 GiB: memo bytes a card needs for weights
    return int(mb * 1024**2)


@dataclass(slots=True)
class _Slot:
    module: weakref.ReferenceType
    sig: tuple[Any, ...]
    payload: Any
    nbytes: int
    refs: tuple[weakref.ReferenceType, ...] = ()  # the weights whose ids ``sig`` holds (alive: ids not reused)


@dataclass
class _Entry:
    key: tuple[Any, ...]
    silu: torch.Tensor | None = None
    slots: dict[tuple[Any, ...], _Slot] = field(default_factory=dict)
    nbytes: int = 0
    # Entries keyed on the timestep: the embedding weights whose ids the key holds, and the temb stock computed.
    refs: tuple[weakref.ReferenceType, ...] = ()
    temb: torch.Tensor | None = None
    temb_version: int | None = None


class ModulationMemo:
    """Entries, one per temb value and numerical settings, hold slots, one per block / projection / ``norm_out``."""

    def __init__(self, max_bytes: int = DEFAULT_BUDGET_MB * 1024**2) -> None:
        self.max_bytes = max_bytes
        self.stats: Counter[str] = Counter()
        self.clear()

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        self._entries: OrderedDict[tuple[Any, ...], _Entry] = OrderedDict()
        self.nbytes = 0  # held within the budget
        # The last digested temb, its version, its entry, its Span (None: not contiguous).
        self._last: tuple[weakref.ReferenceType, int | None, _Entry, Span | None] | None = None
        # Two-segment blocks: the timestep-0 segment per (block, weights, settings).
        self._zero_t: dict[tuple[Any, ...], tuple[weakref.ReferenceType, torch.Tensor, tuple[Any, ...]]] = {}
        self._plan: tuple[weakref.ReferenceType, int | None, SegmentPlan | str] | None = None

    @property
    def zero_t_nbytes(self) -> int:
        """Bytes of the timestep-0 segments (outside the budget)."""
        return tensor_bytes([(raw, segs) for _ref, raw, segs in self._zero_t.values()])

    def configure(self, max_bytes: int) -> None:
        self.max_bytes = int(max_bytes)
        self._evict(keep=None)

    def _evict(self, keep: _Entry | None, need: int = 0) -> None:
        """Drop least-recently-used entries (never ``keep``) until ``need`` more bytes fit in the budget."""
        while self.nbytes + need > self.max_bytes and self._entries:
            key = next(iter(self._entries))
            victim = self._entries[key]
            if victim is keep:
                if len(self._entries) == 1:
                    break
                self._entries.move_to_end(key)
                continue
            del self._entries[key]
            self.nbytes -= victim.nbytes
            self.stats["evictions"] += 1
            if self._last is not None and self._last[2] is victim:
                self._last = None

    def _admit(self, entry: _Entry, nb: int) -> bool:
        """Charge ``nb`` more bytes to ``entry``, evicting others; False: not stored (evicted meanwhile, or no room)."""
        if self._entries.get(entry.key) is not entry:
            return False  # evicted meanwhile (its bytes are already released)
        if self.nbytes + nb > self.max_bytes:
            self._evict(keep=entry, need=nb)
        if self.nbytes + nb > self.max_bytes:
            self.stats["not_stored"] += 1
            return False
        entry.nbytes += nb
        self.nbytes += nb
        return True

    def _store(
        self, entry: _Entry, key: tuple[Any, ...], module: nn.Module, sig: Any, payload: Any, nb: int, lins: tuple
    ) -> None:
        """Keep ``payload`` for ``module`` with weights ``sig`` (of the linears ``lins``, referenced weakly)."""
        if self._entries.get(entry.key) is not entry:
            return  # evicted meanwhile (its bytes are already released)
        old = entry.slots.pop(key, None)
        if old is not None:
            entry.nbytes -= old.nbytes
            self.nbytes -= old.nbytes
        if self._admit(entry, nb):
            entry.slots[key] = _Slot(weakref.ref(module), sig, payload, nb, _refs(lins))

    def _check(self, temb: torch.Tensor) -> None:
        """Raises :class:`Unkeyable` when this call must run stock code (callers checked ``guards.tracing()``)."""
        if self.max_bytes <= 0:
            raise Unkeyable(f"modulation memo budget is 0 ({ENV_BUDGET_MB})")
        if type(temb) is not torch.Tensor:
            raise Unkeyable(f"temb is a {type(temb).__name__}, not a plain tensor")
        if why := guards.call_reason(temb):
            raise Unkeyable(why)

    def _resolve(self, temb: torch.Tensor) -> _Entry:
        """The entry for temb's value (one device->host copy + SHA-256 per new temb object)."""
        version = None if temb.is_inference() else temb._version
        last = self._last
        if last is not None and self._entries.get(last[2].key) is last[2] and last[1] == version:
            if last[0]() is temb:
                entry = last[2]
                self._entries.move_to_end(entry.key)
                return entry
            span = last[3]
            if span is not None and span.contains(temb):
                # A view of the last temb (edit models' ``temb.chunk(2)[0]``) needs no new digest. Matched by storage:
                # under ``inference_mode`` views have no ``_base`` and the base may be gone.
                geometry = (temb.dtype, temb.storage_offset() - span.offset, temb.shape, temb.stride())
                return self._entry(("view", last[2].key, geometry))
        from vllm_omni.diffusion.cache.exact_projection_cache import tensor_digest

        self.stats["digests"] += 1
        entry = self._entry((tensor_digest(temb), str(temb.device), keys.numerical_settings(temb.device.type)))
        self._last = (weakref.ref(temb), version, entry, Span.of(temb))
        return entry

    def time_embedding(
        self, module: nn.Module, timestep: torch.Tensor, hidden_states: torch.Tensor, addition_t_cond: Any, stock: Any
    ) -> tuple[torch.Tensor | None, str | None]:
        """``time_text_embed(...)`` keyed on the timestep's value (a hit: the temb ``stock`` computed), or a reason."""
        try:
            self._check(timestep)
            if torch.is_grad_enabled():
                raise Unkeyable("grad mode is on (the time embedding is keyed for inference only)")
            if why := time_embedding.upstream_reason():
                raise Unkeyable(why)
            if type(hidden_states) is not torch.Tensor:
                raise Unkeyable("hidden_states is not a plain tensor")
            tkey = time_embedding.time_key(module)
            add = addition_t_cond if tkey.use_add else None  # stock ignores it else
            if add is not None and type(add) is not torch.Tensor:
                raise Unkeyable("addition_t_cond is not a plain tensor")
        except Unkeyable as exc:
            return None, str(exc)
        self.stats["digests"] += 1  # B values read back, not temb's B x D
        key = (
            "time",
            time_embedding.value_key(timestep),
            hidden_states.dtype,
            None if add is None else time_embedding.value_key(add),
            keys.numerical_settings(timestep.device.type),
            tkey.sig,
        )
        entry = self._entry(key)
        if not entry.refs or any(ref() is None for ref in entry.refs):  # new, or a weight its key names by id died
            self.nbytes -= entry.nbytes
            entry = self._entries[key] = _Entry(key, refs=_refs(tkey.tensors))
        self.stats["time_keys"] += 1
        temb = entry.temb
        if temb is not None and not temb.is_inference() and temb._version != entry.temb_version:
            temb = entry.temb = None  # written in place since: recompute
        if temb is not None:
            self.stats["time_hits"] += 1
        else:
            temb = stock(module, timestep, hidden_states, addition_t_cond)
            if type(temb) is not torch.Tensor:
                return temb, None  # nothing to key
            if self._admit(entry, tensor_bytes(temb)):
                entry.temb = temb
                entry.temb_version = None if temb.is_inference() else temb._version
        self._last = (weakref.ref(temb), None if temb.is_inference() else temb._version, entry, Span.of(temb))
        return temb, None

    def _entry(self, key: tuple[Any, ...]) -> _Entry:
        entry = self._entries.get(key)
        if entry is None:
            entry = self._entries[key] = _Entry(key)
        else:
            self._entries.move_to_end(key)
        return entry

    def _silu(self, entry: _Entry, temb: torch.Tensor) -> torch.Tensor:
        """SiLU(temb), once per entry (as stock's out-of-place ``nn.SiLU``)."""
        if entry.silu is not None:
            return entry.silu
        self.stats["silu"] += 1
        silu = F.silu(temb)
        if self._admit(entry, silu.numel() * silu.element_size()):  # within the budget like every payload
            entry.silu = silu
        return silu

    @staticmethod
    def _lookup(entry: _Entry, key: tuple[Any, ...], module: nn.Module, sig: Any) -> Any:
        slot = entry.slots.get(key)
        if slot is None or slot.module() is not module or slot.sig != sig:
            return None
        for ref in slot.refs:
            if ref() is None:
                return None  # a dead weight: its id in sig may be another tensor's now
        return slot.payload

    def _hit(self, entry: _Entry, key: tuple[Any, ...], module: nn.Module, sig: Any) -> Any:
        found = self._lookup(entry, key, module, sig)
        self.stats["hits" if found is not None else "misses"] += 1
        return found

    def _projection(self, entry: _Entry, seq: nn.Module, lin: nn.Module, sig: Any, temb: torch.Tensor) -> torch.Tensor:
        """``seq(temb)`` for a ``Sequential(SiLU, Linear)``: reuse a stored direct-call result, else replay."""
        raw = self._lookup(entry, ("raw", id(seq)), seq, sig)
        if raw is not None:
            return raw
        self.stats["projections"] += 1
        return lin(self._silu(entry, temb))

    def direct_projection(self, seq: nn.Module, temb: torch.Tensor) -> tuple[torch.Tensor | None, str | None]:
        """``seq(temb)`` for direct calls of ``img_mod``/``txt_mod`` (TeaCache's probe), or a fallback reason."""
        try:
            self._check(temb)
            lin = keys.silu_linear(seq)
            sig = keys.linear_sig(lin, torch.is_grad_enabled())
        except Unkeyable as exc:
            return None, str(exc)
        entry = self._resolve(temb)
        key = ("raw", id(seq))
        raw = self._hit(entry, key, seq, sig)
        if raw is None:
            raw = self._projection(entry, seq, lin, sig, temb)
            self._store(entry, key, seq, sig, raw, tensor_bytes(raw), (lin,))
        return raw, None

    def block(self, block: nn.Module, temb: torch.Tensor) -> tuple[tuple[NormMod, ...] | None, str | None]:
        """The unpacked modulations (img1, img2, txt1, txt2) of ``block`` for ``temb``, or a fallback reason."""
        try:
            self._check(temb)
            img_lin, txt_lin, kinds, sig_img, sig_txt = keys.block_parts(block)
        except Unkeyable as exc:
            return None, str(exc)
        sig = (sig_img, sig_txt, kinds)
        entry = self._resolve(temb)
        key = ("block", id(block))
        mods = self._hit(entry, key, block, sig)
        if mods is None:  # replay stock: img_mod(temb), txt_mod(temb), chunk(2), _modulate -> (scale, shift, gate)
            params = (
                *self._projection(entry, block.img_mod, img_lin, sig_img, temb).chunk(2, dim=-1),
                *self._projection(entry, block.txt_mod, txt_lin, sig_txt, temb).chunk(2, dim=-1),
            )
            mods = tuple(NormMod.unpack(*block._modulate(p), kind) for p, kind in zip(params, kinds, strict=True))
            self._store(entry, key, block, sig, mods, sum(m.nbytes() for m in mods), (img_lin, txt_lin))
        return mods, None

    def segment_plan(self, index: torch.Tensor) -> tuple[SegmentPlan | None, str | None]:
        """The :class:`SegmentPlan` of ``modulate_index``, once per index tensor (one per forward, shared by blocks)."""
        version = None if index.is_inference() else index._version
        cached = self._plan
        if cached is not None and cached[0]() is index and cached[1] == version:
            plan = cached[2]
        else:
            self.stats["plans"] += 1
            try:
                plan = SegmentPlan.of(index)
            except ValueError as exc:
                plan = str(exc)
            self._plan = (weakref.ref(index), version, plan)
        return (plan, None) if isinstance(plan, SegmentPlan) else (None, plan)

    def _zero_t_segments(
        self, block: nn.Module, sig: Any, raw: torch.Tensor, halves: tuple[Any, ...]
    ) -> tuple[tuple[torch.Tensor, ...], ...]:
        """Segment 1 (timestep 0) of ``block``'s image norms (from ``halves``), reused while ``raw`` matches bitwise."""
        settings = keys.numerical_settings(raw.device.type)
        key = ("zero_t", id(block), sig, raw.shape, raw.dtype, str(raw.device), settings)
        stored = self._zero_t.get(key)
        if stored is not None and stored[0]() is block:
            if torch.equal(stored[1], raw):
                self.stats["zero_t_hits"] += 1
                return stored[2]
            self.stats["zero_t_mismatch"] += 1
        self.stats["zero_t_misses"] += 1
        segs = tuple(SegMod.segment(*h) for h in halves)
        for k in [k for k, v in self._zero_t.items() if v[0]() is None or (k[1] == id(block) and k != key)]:
            del self._zero_t[k]  # dead blocks and this block's older weights / settings
        self._zero_t[key] = (weakref.ref(block), raw.clone(), segs)
        return segs

    def block_two_segment(
        self, block: nn.Module, temb: torch.Tensor, index: torch.Tensor, hidden_states: torch.Tensor
    ) -> tuple[tuple[Any, ...] | None, str | None]:
        """``(SegMod img1, SegMod img2, NormMod txt1, NormMod txt2)`` of a ``zero_cond_t`` block, or a reason."""
        batch = hidden_states.shape[0]
        try:
            self._check(temb)
            if sys.modules[targets.TRANSFORMER].can_use_qwen_select01_triton(hidden_states):
                raise Unkeyable("the fused Triton select01 kernels are the stock path here (CUDA)")
            if temb.dim() != 2 or temb.shape[0] != 2 * batch or index.shape[0] not in (1, batch):
                raise Unkeyable("two-segment modulation with an unexpected temb / modulate_index batch")
            if index.shape[-1] != hidden_states.shape[1]:
                raise Unkeyable("modulate_index does not match the image sequence")
            img_lin, txt_lin, kinds, sig_img, sig_txt = keys.block_parts(block)
            if ada_norm.OPAQUE in kinds[:2]:
                raise Unkeyable("a fused (MindIE-SD) image AdaLayerNorm takes per-token scale tensors")
            plan, why = self.segment_plan(index)
            if plan is None:
                raise Unkeyable(why)
        except Unkeyable as exc:
            return None, str(exc)
        sig = (sig_img, sig_txt, kinds)
        entry = self._resolve(temb)
        key = ("block2", id(block), plan, hidden_states.dtype)
        mods = self._hit(entry, key, block, sig)
        if mods is not None:
            return mods, None
        # Replay of stock: img_mod(temb) (2B rows), txt_mod(temb.chunk(2, dim=0)[0]), chunk(2), select01 halves.
        img_params = self._projection(entry, block.img_mod, img_lin, sig_img, temb)
        temb_txt = torch.chunk(temb, 2, dim=0)[0]
        txt_params = self._projection(self._resolve(temb_txt), block.txt_mod, txt_lin, sig_txt, temb_txt)
        sel = sys.modules[keys.SELECT01_MODULE]
        splits = [sel.split_select01_mod_params(m) for m in img_params.chunk(2, dim=-1)]  # (scale0, ..., gate1)
        zero = self._zero_t_segments(block, (sig_img, kinds[:2]), img_params[batch:], tuple(sp[3:] for sp in splits))
        img = tuple(
            SegMod.build((SegMod.segment(*sp[:3]), z), kind, plan)
            for sp, z, kind in zip(splits, zero, kinds[:2], strict=True)
        )
        txt = tuple(
            NormMod.unpack(*block._modulate(p), kind)
            for p, kind in zip(txt_params.chunk(2, dim=-1), kinds[2:], strict=True)
        )
        mods = (*img, *txt)
        nb = sum(m.nbytes(0) for m in img) + sum(m.nbytes() for m in txt)
        self._store(entry, key, block, sig, mods, nb, (img_lin, txt_lin))
        return mods, None

    def norm_out(self, norm: nn.Module, x: torch.Tensor, cond: torch.Tensor) -> tuple[Any, str | None]:
        """``((1 + scale)[:, None, :], shift[:, None, :])`` of diffusers' AdaLayerNormContinuous, or a reason."""
        try:
            self._check(cond)
            sig = keys.norm_out_sig(norm, torch.is_grad_enabled())
        except Unkeyable as exc:
            return None, str(exc)
        entry = self._resolve(cond)
        key = ("norm_out", id(norm), x.dtype)
        mods = self._hit(entry, key, norm, sig)
        if mods is None:
            self.stats["projections"] += 1  # diffusers' AdaLayerNormContinuous.forward up to the norm
            scale, shift = torch.chunk(norm.linear(self._silu(entry, cond).to(x.dtype)), 2, dim=1)
            mods = ((1 + scale)[:, None, :], shift[:, None, :].clone(memory_format=torch.contiguous_format))
            self._store(entry, key, norm, sig, mods, tensor_bytes(mods), (norm.linear,))
        return mods, None

    def has_block(self, block: nn.Module, temb: torch.Tensor) -> bool:
        """Whether :meth:`block` (single-segment) would hit now; nothing is computed, stored or counted."""
        try:
            self._check(temb)
            _img, _txt, kinds, sig_img, sig_txt = keys.block_parts(block)
        except Unkeyable:
            return False
        entry = self._resolve(temb)
        return self._lookup(entry, ("block", id(block)), block, (sig_img, sig_txt, kinds)) is not None


def _refs(objs: tuple[Any, ...]) -> tuple[weakref.ReferenceType, ...]:
    """Weak references to the tensors of ``objs`` (a linear: its :func:`~.keys.sig_tensors`)."""
    return tuple(weakref.ref(t) for x in objs for t in (keys.sig_tensors(x) if isinstance(x, nn.Module) else (x,)))


#: ``shared_modulation``'s memo while installed (``memo_aware_offload`` asks it).
MEMO: Slot[ModulationMemo] = Slot("modulation memo")
