"""The modulation memo: an exact, byte-bounded LRU memo of Qwen-Image's modulation tensors, keyed on the value of
the timestep embedding ``temb`` and on the weights.

``shared_modulation`` owns one (its ``memo``); the memo's keys and weight signatures are in :mod:`.keys`,
the unpacked payloads in :mod:`..body.block_body` (:class:`NormMod`) and :mod:`..body.two_segment` (:class:`SegMod`).

Cache policy (each pinned by a test in tests/test_shared_modulation.py and a named mutation):

* **Key**: the value of ``temb`` (dtype, shape, device and a SHA-256 of its bytes, upstream's ``tensor_digest``;
  a view of the last digested temb is keyed by its geometry instead) and the numerical settings; per slot (block,
  direct projection, ``norm_out``), the module and its weight signature. A slot is reused only while its module is
  alive and its signature unchanged; a miss replays stock's computation, so a hit is bitwise stock's result.
* **LRU order**: a hit (or a new slot) moves its entry to the most recent end; eviction takes the least recently
  used entry first, never the entry being filled.
* **Byte budget** (``VLLM_OMNI_ASCEND_OPT_MODULATION_CACHE_MB``, default 512 MiB): the bytes held (SiLU(temb) and
  every payload) never exceed it; a payload that cannot fit even after evicting every other entry is not stored
  (``stats["not_stored"]``) and is recomputed next time. Budget 0 disables the memo (every call runs stock code,
  with the reason).
* **Invalidation**: :meth:`ModulationMemo.clear` drops everything (the owner calls it on ``load_weights``, on the
  registry's weights-changed event, on detach and uninstall). Version counters catch in-place writes by themselves.
* **Timestep-0 segments** (two-segment blocks): kept outside the LRU budget, one per block and weights signature,
  for the model's life; a new signature replaces the block's older one, dead blocks are dropped.
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
from vllm_omni_ascend_opt.blocks.memo import time_embedding
from vllm_omni_ascend_opt.blocks.memo.keys import (
    SELECT01_MODULE,
    Span,
    Unkeyable,
    block_parts,
    linear_sig,
    norm_out_sig,
    numerical_settings,
    sig_tensors,
    silu_linear,
)
from vllm_omni_ascend_opt.blocks.slots import Slot
from vllm_omni_ascend_opt.blocks.upstream import ada_norm, guards, targets

ENV_BUDGET_MB = "VLLM_OMNI_ASCEND_OPT_MODULATION_CACHE_MB"
DEFAULT_BUDGET_MB = 512


def budget_from_env() -> int:
    """The memo's byte budget from ``VLLM_OMNI_ASCEND_OPT_MODULATION_CACHE_MB`` (MiB, default 512)."""
    raw = os.environ.get(ENV_BUDGET_MB, "").strip()
    if not raw:
        return DEFAULT_BUDGET_MB * 1024**2
    mb = float(raw)  # ValueError for junk; reasons_inactive() reports it
    if not 0 <= mb < float("inf"):  # also rejects NaN
        raise ValueError(f"{ENV_BUDGET_MB}={raw!r} must be a non-negative number of MiB")
    _env.check_range(ENV_BUDGET_MB, mb, 0, 16384, " MiB")  # above 16 GiB: memo bytes a card needs for weights
    return int(mb * 1024**2)


@dataclass(slots=True)
class _Slot:
    module: weakref.ReferenceType
    sig: tuple[Any, ...]
    payload: Any
    nbytes: int
    #: weak references to the weights whose ids ``sig`` holds: while all are alive no other tensor can have their ids
    refs: tuple[weakref.ReferenceType, ...] = ()


@dataclass
class _Entry:
    key: tuple[Any, ...]
    silu: torch.Tensor | None = None
    slots: dict[tuple[Any, ...], _Slot] = field(default_factory=dict)
    nbytes: int = 0
    #: entries keyed on the timestep: weak references to the time embedding's weights whose ids the key holds
    refs: tuple[weakref.ReferenceType, ...] = ()
    #: entries keyed on the timestep: the temb stock computed on the miss (returned by every hit)
    temb: torch.Tensor | None = None
    temb_version: int | None = None


class ModulationMemo:
    """The memo (policy: module docstring): entries, one per distinct temb value and numerical settings, hold slots,
    one per block / direct projection / ``norm_out``."""

    def __init__(self, max_bytes: int = DEFAULT_BUDGET_MB * 1024**2) -> None:
        self.max_bytes = max_bytes
        self._entries: OrderedDict[tuple[Any, ...], _Entry] = OrderedDict()
        self._bytes = 0
        # (the last digested temb, its version, its entry, its Span or None when not contiguous)
        self._last: tuple[weakref.ReferenceType, int | None, _Entry, Span | None] | None = None
        self.stats: Counter[str] = Counter()
        # Two-segment blocks: the timestep-0 segment per (block, weights, settings), for the model's life.
        self._zero_t: dict[tuple[Any, ...], tuple[weakref.ReferenceType, torch.Tensor, tuple[Any, ...]]] = {}
        self._plan: tuple[weakref.ReferenceType, int | None, SegmentPlan | str] | None = None

    # ----- bookkeeping ------------------------------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        self._entries.clear()
        self._bytes = 0
        self._last = None
        self._zero_t.clear()
        self._plan = None

    @property
    def zero_t_nbytes(self) -> int:
        """Bytes of the timestep-0 segments (outside the LRU budget: one per block and weights)."""
        return sum(
            raw.numel() * raw.element_size() + sum(t.numel() * t.element_size() for seg in segs for t in seg)
            for _ref, raw, segs in self._zero_t.values()
        )

    def configure(self, max_bytes: int) -> None:
        self.max_bytes = int(max_bytes)
        self._evict(keep=None)

    def _evict(self, keep: _Entry | None, need: int = 0) -> None:
        """Drop least-recently-used entries (never ``keep``) until ``need`` more bytes fit in the budget."""
        while self._bytes + need > self.max_bytes and self._entries:
            key = next(iter(self._entries))
            victim = self._entries[key]
            if victim is keep:
                if len(self._entries) == 1:
                    break
                self._entries.move_to_end(key)
                continue
            del self._entries[key]
            self._bytes -= victim.nbytes
            self.stats["evictions"] += 1
            if self._last is not None and self._last[2] is victim:
                self._last = None

    def _admit(self, entry: _Entry, nb: int) -> bool:
        """Charge ``nb`` more bytes to ``entry`` within the budget, evicting least-recently-used other entries as
        needed. False: not stored (``entry`` was evicted meanwhile, or ``nb`` cannot fit: counted as not_stored)."""
        if self._entries.get(entry.key) is not entry:
            return False  # evicted meanwhile (its bytes are already released)
        if self._bytes + nb > self.max_bytes:
            self._evict(keep=entry, need=nb)
        if self._bytes + nb > self.max_bytes:
            self.stats["not_stored"] += 1
            return False
        entry.nbytes += nb
        self._bytes += nb
        return True

    def _store(
        self,
        entry: _Entry,
        key: tuple[Any, ...],
        module: nn.Module,
        sig: Any,
        payload: Any,
        nb: int,
        lins: tuple[Any, ...] | list[Any],
    ) -> None:
        """Keep ``payload`` in ``entry`` under ``key`` for ``module`` with weights ``sig`` (of the linears or tensors
        ``lins``: the slot keeps weak references to every tensor whose id ``sig`` holds)."""
        if self._entries.get(entry.key) is not entry:
            return  # evicted meanwhile (its bytes are already released)
        old = entry.slots.pop(key, None)
        if old is not None:
            entry.nbytes -= old.nbytes
            self._bytes -= old.nbytes
        if self._admit(entry, nb):
            tensors = [t for x in lins for t in (sig_tensors(x) if isinstance(x, nn.Module) else (x,))]
            entry.slots[key] = _Slot(weakref.ref(module), sig, payload, nb, tuple(weakref.ref(t) for t in tensors))

    # ----- lookups ----------------------------------------------------------------------------------------
    def _precheck(self, temb: torch.Tensor) -> str | None:
        """Why this call must run stock code before any key is made (the callers checked guards.tracing() first)."""
        if self.max_bytes <= 0:
            return f"modulation memo budget is 0 ({ENV_BUDGET_MB})"
        if type(temb) is not torch.Tensor:
            return f"temb is a {type(temb).__name__}, not a plain tensor"
        return guards.call_reason(temb)  # autograd on temb, CUDA/NPU graph capture, global module hooks

    def _resolve(self, temb: torch.Tensor) -> _Entry:
        """The entry for temb's value (one device->host copy + SHA-256 per new temb object)."""
        version = None if temb.is_inference() else temb._version
        last = self._last
        if last is not None and self._entries.get(last[2].key) is last[2] and last[1] == version:
            obj = last[0]()
            if obj is temb:
                entry = last[2]
                self._entries.move_to_end(entry.key)
                return entry
            span = last[3]
            if span is not None and span.contains(temb):
                # A view of the last temb (edit models' ``temb.chunk(2)[0]``, made anew in every block, and the one
                # norm_out gets after the model rebinds ``temb`` to it) needs no new digest (:meth:`Span.contains`).
                # Matched by storage, not ``_base`` or the base object: under ``inference_mode`` (vLLM-Omni's runner)
                # views have no ``_base`` and the base may be gone.
                geometry = (temb.dtype, temb.storage_offset() - span.offset, temb.shape, temb.stride())
                return self._entry(("view", last[2].key, geometry))
        from vllm_omni.diffusion.cache.exact_projection_cache import tensor_digest

        self.stats["digests"] += 1
        entry = self._entry((tensor_digest(temb), str(temb.device), numerical_settings(temb.device.type)))
        self._last = (weakref.ref(temb), version, entry, Span.of(temb))
        return entry

    def _reset(self, entry: _Entry) -> None:
        """Drop everything ``entry`` holds (its temb changed under the same key): its slots and SiLU(temb)."""
        self._bytes -= entry.nbytes
        entry.nbytes = 0
        entry.slots.clear()
        entry.silu = None
        entry.refs = ()
        entry.temb = None

    def time_embedding(
        self,
        module: nn.Module,
        timestep: torch.Tensor,
        hidden_states: torch.Tensor,
        addition_t_cond: Any,
        stock: Any,
    ) -> tuple[torch.Tensor | None, str | None]:
        """``time_text_embed(timestep, hidden_states, addition_t_cond)`` keyed on the timestep's value (counted as
        ``digests``; :mod:`.time_embedding`): the entry keeps the temb ``stock`` computed on its miss and a hit returns
        that very tensor (``time_hits``). Like the block slots, this relies on nobody writing into temb in place
        (vLLM-Omni's transformer and cache hooks only read it). (temb, None), or (None, why the memo does not key it:
        the blocks then digest temb)."""
        why = self._precheck(timestep)
        if why is None and torch.is_grad_enabled():
            why = "grad mode is on (the time embedding is keyed for inference only)"
        if why is None:
            why = time_embedding.upstream_reason()
        if why:
            return None, why
        if type(hidden_states) is not torch.Tensor:
            return None, "hidden_states is not a plain tensor"
        try:
            tkey = time_embedding.time_key(module, grad=False)
        except Unkeyable as exc:
            return None, str(exc)
        sig, tensors = tkey.sig, tkey.tensors
        add = addition_t_cond if tkey.use_add else None  # stock ignores it else
        if add is not None and type(add) is not torch.Tensor:
            return None, "addition_t_cond is not a plain tensor"
        self.stats["digests"] += 1  # the one device->host read of this forward (B values, not temb's B x D)
        key = (
            "time",
            time_embedding.value_key(timestep),
            hidden_states.dtype,
            None if add is None else time_embedding.value_key(add),
            numerical_settings(timestep.device.type),
            sig,
        )
        entry = self._entry(key)
        if any(ref() is None for ref in entry.refs):
            self._reset(entry)  # a weight named by id in the key died: its id may be another tensor's now
        if not entry.refs:
            entry.refs = tuple(
                weakref.ref(t) for x in tensors for t in (sig_tensors(x) if isinstance(x, nn.Module) else (x,))
            )
        self.stats["time_keys"] += 1
        temb = entry.temb
        if temb is not None and not temb.is_inference() and temb._version != entry.temb_version:
            temb = entry.temb = None  # written in place since (outside inference mode): recompute
        if temb is not None:
            self.stats["time_hits"] += 1
        else:
            temb = stock(module, timestep, hidden_states, addition_t_cond)
            if type(temb) is not torch.Tensor:
                return temb, None  # nothing to key (not reached with vLLM-Omni's module)
            if self._admit(entry, temb.numel() * temb.element_size()):  # within the budget like every payload
                entry.temb = temb
                entry.temb_version = None if temb.is_inference() else temb._version
        self._last = (weakref.ref(temb), None if temb.is_inference() else temb._version, entry, Span.of(temb))
        return temb, None

    def _entry(self, key: tuple[Any, ...]) -> _Entry:
        entry = self._entries.get(key)
        if entry is None:
            entry = _Entry(key)
            self._entries[key] = entry
        else:
            self._entries.move_to_end(key)
        return entry

    def _silu(self, entry: _Entry, temb: torch.Tensor) -> torch.Tensor:
        """SiLU(temb), once per entry (stock: nn.SiLU() -> F.silu(temb, inplace=False))."""
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
        if slot is not None and slot.module() is module and slot.sig == sig:
            for ref in slot.refs:  # the weights named by id in sig are still those objects (none died meanwhile)
                if ref() is None:
                    return None
            return slot.payload
        return None

    def _hit(self, entry: _Entry, key: tuple[Any, ...], module: nn.Module, sig: Any) -> Any:
        """:meth:`_lookup`, counted as a hit or a miss."""
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
        """``seq(temb)`` for direct calls of ``img_mod``/``txt_mod`` (TeaCache's probe). (result, fallback reason)."""
        why = self._precheck(temb)
        if why:
            return None, why
        try:
            lin = silu_linear(seq)
            sig = linear_sig(lin, torch.is_grad_enabled())
        except Unkeyable as exc:
            return None, str(exc)
        entry = self._resolve(temb)
        key = ("raw", id(seq))
        raw = self._hit(entry, key, seq, sig)
        if raw is not None:
            return raw, None
        self.stats["projections"] += 1
        raw = lin(self._silu(entry, temb))
        self._store(entry, key, seq, sig, raw, raw.numel() * raw.element_size(), (lin,))
        return raw, None

    def block(self, block: nn.Module, temb: torch.Tensor) -> tuple[tuple[NormMod, ...] | None, str | None]:
        """The four unpacked modulations (img1, img2, txt1, txt2) of ``block`` for ``temb``, or a fallback reason."""
        why = self._precheck(temb)
        if why:
            return None, why
        try:
            img_lin, txt_lin, kinds, sig_img, sig_txt = block_parts(block)
        except Unkeyable as exc:
            return None, str(exc)
        sig = (sig_img, sig_txt, kinds)
        entry = self._resolve(temb)
        key = ("block", id(block))
        mods = self._hit(entry, key, block, sig)
        if mods is not None:
            return mods, None
        # Replay of stock: img_mod(temb), txt_mod(temb), chunk(2), _modulate -> (scale, shift, gate) views.
        img_params = self._projection(entry, block.img_mod, img_lin, sig_img, temb)
        txt_params = self._projection(entry, block.txt_mod, txt_lin, sig_txt, temb)
        img_mod1, img_mod2 = img_params.chunk(2, dim=-1)
        txt_mod1, txt_mod2 = txt_params.chunk(2, dim=-1)
        mods = tuple(
            NormMod.unpack(*block._modulate(p), kind)
            for p, kind in zip((img_mod1, img_mod2, txt_mod1, txt_mod2), kinds, strict=True)
        )
        self._store(entry, key, block, sig, mods, sum(m.nbytes() for m in mods), (img_lin, txt_lin))
        return mods, None

    # ----- two-segment (zero_cond_t) blocks ------------------------------------------------------------------
    def segment_plan(self, index: torch.Tensor) -> tuple[SegmentPlan | None, str | None]:
        """The :class:`SegmentPlan` of ``modulate_index``: computed once per index tensor (vLLM-Omni makes one per
        transformer forward and hands the same object to every block), one device->host copy."""
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
        """Segment 1 (timestep 0) of ``block``'s two image norms, kept once per block and weights signature.

        ``raw`` is this forward's timestep-0 rows of ``img_mod(temb)`` (stock's 2B-row projection) and ``halves``
        its ``(scale1, shift1, gate1)`` per norm. The stored segments are reused only while they equal ``raw``
        bit for bit (one comparison per miss): a 2B-row GEMM computes each row from that row alone, so they do
        for fixed weights, batch, dtype and settings -- ``zero_t_mismatch`` would count the contrary."""
        key = ("zero_t", id(block), sig, raw.shape, raw.dtype, str(raw.device), numerical_settings(raw.device.type))
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
        """``(SegMod img1, SegMod img2, NormMod txt1, NormMod txt2)`` of a ``zero_cond_t`` block, or a reason.

        Replays stock exactly on a miss: ``img_mod(temb)`` on all 2B rows (``[t, 0]`` embeddings), ``txt_mod`` on
        ``temb.chunk(2)[0]``, ``split_select01_mod_params`` per image norm."""
        why = self._precheck(temb)
        if why:
            return None, why
        sel = sys.modules[SELECT01_MODULE]
        if sys.modules[targets.TRANSFORMER].can_use_qwen_select01_triton(hidden_states):  # the block's own test
            return None, "the fused Triton select01 kernels are the stock path here (CUDA)"
        batch = hidden_states.shape[0]
        if temb.dim() != 2 or temb.shape[0] != 2 * batch or index.shape[0] not in (1, batch):
            return None, "two-segment modulation with an unexpected temb / modulate_index batch"
        if index.shape[-1] != hidden_states.shape[1]:
            return None, "modulate_index does not match the image sequence"
        try:
            img_lin, txt_lin, kinds, sig_img, sig_txt = block_parts(block)
        except Unkeyable as exc:
            return None, str(exc)
        if ada_norm.OPAQUE in kinds[:2]:
            return None, "a fused (MindIE-SD) image AdaLayerNorm takes per-token scale tensors"
        plan, why = self.segment_plan(index)
        if plan is None:
            return None, why
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
        img_mods = img_params.chunk(2, dim=-1)
        splits = [sel.split_select01_mod_params(m) for m in img_mods]  # (scale0, shift0, gate0, scale1, ...)
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
        why = self._precheck(cond)
        if why:
            return None, why
        try:
            sig = norm_out_sig(norm, torch.is_grad_enabled())
        except Unkeyable as exc:
            return None, str(exc)
        entry = self._resolve(cond)
        key = ("norm_out", id(norm), x.dtype)
        mods = self._hit(entry, key, norm, sig)
        if mods is not None:
            return mods, None
        self.stats["projections"] += 1
        # Replay of diffusers 0.40 AdaLayerNormContinuous.forward up to the norm.
        emb = norm.linear(self._silu(entry, cond).to(x.dtype))
        scale, shift = torch.chunk(emb, 2, dim=1)
        mods = ((1 + scale)[:, None, :], shift[:, None, :].clone(memory_format=torch.contiguous_format))
        self._store(entry, key, norm, sig, mods, sum(t.numel() * t.element_size() for t in mods), (norm.linear,))
        return mods, None

    # ----- read-only queries (memo_aware_offload) ---------------------------------------------------------------
    def has_block(self, block: nn.Module, temb: torch.Tensor) -> bool:
        """Whether :meth:`block` would hit for ``block`` and ``temb`` right now, with the block's parameters as they
        are: nothing is computed, stored or counted (a new ``temb`` is digested once, as :meth:`block` would).
        Single-segment blocks only."""
        if self._precheck(temb):
            return False
        try:
            _img, _txt, kinds, sig_img, sig_txt = block_parts(block)
        except Unkeyable:
            return False
        entry = self._resolve(temb)
        return self._lookup(entry, ("block", id(block)), block, (sig_img, sig_txt, kinds)) is not None


#: The modulation memo on offer: ``shared_modulation`` provides its memo while installed (``memo_aware_offload`` asks it).
MEMO: Slot[ModulationMemo] = Slot("modulation memo")
