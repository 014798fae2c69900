"""One cache for kernel verdicts, with one invalidation rule.

Every kernel path the plugin takes on an NPU is verified before use (per device and dtype, and again per *shape
class* on the first real call): ``rope``'s ``npu_rotary_mul``, ``qk_norm``'s ``npu_rms_norm``, ``fused_attention``'s
``npu_fusion_attention``, ``nz_weights``' FRACTAL_NZ linears, ``vae_exact``'s native-dtype upsample.

The rule: a verdict belongs to the backend probe (:func:`vllm_omni_ascend_opt._backend.probe_id`) it was made under;
when the probe changes (another ``torch_npu`` module, or a re-probe after ``_backend.reset_cache``), every entry is
dropped before the next read or write. ``clear()`` drops them too (an optimization's ``uninstall``). Nothing else
removes a verdict: a shape class keeps its verdict for the life of the process.

A cache made with ``saved_as`` (the kernel's name) and ``decode`` also reads and writes the on-disk verdicts of
:mod:`.saved`: a miss in memory asks the disk, once per class and probe (a hit there is decoded and kept, no check
runs; a class in fault backoff is not asked again on every call), and every verdict put is saved. Faults never come here (:mod:`.guard` keeps them).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

from vllm_omni_ascend_opt import _backend
from vllm_omni_ascend_opt.blocks.kernels import agree, saved

V = TypeVar("V")


class VerdictCache(Generic[V]):
    """Verdicts by key, valid for the backend probe they were made under (see the module docstring)."""

    def __init__(
        self, saved_as: str | None = None, decode: Callable[[Hashable, bool, str], V | None] | None = None
    ) -> None:
        self._entries: dict[Hashable, V] = {}
        self._probe: int | None = None
        self._saved_as = saved_as if decode is not None else None
        self._decode = decode
        #: verdicts read from disk instead of being checked (under the current probe)
        self.loaded = 0
        #: refusals other ranks made (key text -> reason), applied on this rank's first lookup of the class
        self._remote: dict[str, str] = {}
        #: passes this rank made (or read) in the current forward, held back until the ranks agree (:meth:`_hold`)
        self._held: dict[Hashable, V] = {}
        #: classes already asked of the disk under the current probe (a miss there is not asked again per call)
        self._asked: set[Hashable] = set()
        if self._saved_as is not None:
            agree.register(self)

    def _live(self) -> dict[Hashable, V]:
        probe = _backend.probe_id()
        if probe != self._probe:
            self._entries.clear()
            self._probe = probe
            self.loaded = 0
            self._remote.clear()
            self._held.clear()
            self._asked.clear()
        return self._entries

    def get(self, key: Hashable) -> V | None:
        entries = self._live()
        v = entries.get(key)
        if v is None and self._saved_as is not None and key not in self._asked:
            self._asked.add(key)
            v = self._from_disk(entries, key)
        return v

    def _from_disk(self, entries: dict[Hashable, V], key: Hashable) -> V | None:
        remote = self._remote.get(saved.key_text(key)) if self._remote else None
        hit = (False, remote) if remote is not None else saved.lookup(self._saved_as, key)  # type: ignore[arg-type]
        if hit is None:
            return None
        v = self._decode(key, hit[0], hit[1])  # type: ignore[misc]
        if v is not None:  # None: the owner does not take it here (e.g. another policy); the check runs
            entries[key] = v
            self.loaded += 1
            if remote is None:
                agree.made(self, key, hit[0], hit[1])
                v = self._hold(entries, key, v)
        return v

    def put(self, key: Hashable, verdict: V) -> V:
        entries = self._live()
        entries[key] = verdict
        if self._saved_as is not None:
            ok = bool(getattr(verdict, "ok", False))
            why = str(getattr(verdict, "reason", "") or getattr(verdict, "detail", ""))
            saved.save(self._saved_as, key, ok, why)
            agree.made(self, key, ok, why)
            verdict = self._hold(entries, key, verdict)
        return verdict

    def _hold(self, entries: dict[Hashable, V], key: Hashable, verdict: V) -> V:
        """Under several ranks, a pass is not used before every rank has agreed (at the end of the forward,
        :func:`.agree.sync`): until then the class takes the stock path on this rank, as it does on a rank that
        refused it, so the ranks of one image never run different kernels, not even in the forward that checked."""
        if not getattr(verdict, "ok", False) or self._decode is None or not agree.multi_rank():
            return verdict
        waiting = self._decode(key, False, agree.WAITING)
        if waiting is None:
            return verdict
        self._held[key] = verdict
        entries[key] = waiting
        return waiting

    def release_held(self) -> int:
        """The ranks have agreed: the passes held back in this forward take effect (a peer's refusal has already
        replaced any of them); returns how many."""
        if not self._held:
            return 0
        entries, n = self._live(), 0
        for key, verdict in self._held.items():
            entries[key], n = verdict, n + 1
        self._held.clear()
        return n

    @property
    def name(self) -> str | None:
        """The kernel name its verdicts are saved and agreed under (None: kept in memory only)."""
        return self._saved_as

    def refuse_from_peer(self, text: str, reason: str) -> None:
        """Another rank refused the class ``text`` (:func:`.saved.key_text`): refuse it here too, now if this rank
        holds a verdict for it (a pass becomes the peer's refusal; never saved: the peer saved its own), else at
        this rank's first lookup of it."""
        entries = self._live()
        held = [key for key in self._held if saved.key_text(key) == text]
        for key in held:
            del self._held[key]
        for key, v in list(entries.items()):
            if saved.key_text(key) == text:
                if (getattr(v, "ok", False) or key in held) and self._decode is not None:
                    refused = self._decode(key, False, reason)
                    if refused is not None:
                        entries[key] = refused
                return
        self._remote[text] = reason
        self._asked -= {key for key in self._asked if saved.key_text(key) == text}

    def get_or_make(self, key: Hashable, make: Callable[[], V]) -> tuple[V, bool]:
        """``(verdict, made)``: the cached verdict for ``key``, or ``make()``'s, stored (``made`` True)."""
        v = self.get(key)
        if v is not None:
            return v, False
        return self.put(key, make()), True

    def drop(self, key: Hashable) -> None:
        """Forget ``key`` (a fault that cleared; never a verdict: see the module docstring)."""
        self._live().pop(key, None)

    def values(self) -> list[V]:
        return list(self._live().values())

    def clear(self) -> None:
        self._entries.clear()
        self._asked.clear()

    def __len__(self) -> int:
        return len(self._live())
