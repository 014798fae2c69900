"""The one verified-kernel template: every kernel path the plugin takes on an NPU is a :class:`KernelPath`.

A subclass declares its ``kernel`` name, its :class:`Candidate` list, how its keys read (:meth:`KernelPath.place`)
and, per call, its shape class, its check and that check's scratch, the stock call, and further candidates. The
template does the rest: the verdict lookup (:class:`VerdictStore`: memory, a peer rank's refusal, the disk once per
probe), the fault wait, the guarded check-and-call (:mod:`.guard`; a check whose scratch does not fit is deferred),
the timing against stock (:mod:`.timing`), and the status tally. A first-use check that hands back no kernel output
goes through :meth:`KernelPath.decide`. None from either means: stock.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

import torch

from vllm_omni_ascend_opt import _backend
from vllm_omni_ascend_opt.blocks.kernels import agree, saved, timing
from vllm_omni_ascend_opt.blocks.kernels.guard import Guard, is_error, where
from vllm_omni_ascend_opt.blocks.kernels.verdicts import ProbeDict, Verdict

logger = logging.getLogger("vllm_omni_ascend_opt")
T = TypeVar("T")


@dataclass(frozen=True)
class Candidate:
    """A torch_npu function a kernel path may run, and the equivalence tier it puts its optimization in."""

    name: str
    tier: str
    op: str = ""  # the torch_npu function (default: ``name``)


class VerdictStore:
    """The verdicts of one kernel by key, for the current backend probe; with ``persist``, every verdict made is saved
    and agreed with the other ranks, and a miss asks a peer's refusal, then the disk (once per class and probe)."""

    def __init__(self, kernel: str, path: KernelPath, persist: bool) -> None:
        self.kernel = kernel
        self._path = path
        self._persist = persist
        self._mem: ProbeDict[Verdict] = ProbeDict(lambda: agree.forget(kernel))
        #: verdicts read from disk instead of being checked (under the current probe)
        self.loaded = 0
        if persist:
            agree.register(self)

    def get(self, key: Hashable) -> Verdict | None:
        v = self._mem.get(key)
        if v is None and self._persist:
            why = agree.peer_refusal(self.kernel, key)
            if why is not None:
                return self._mem.put(key, self._path.verdict(key, False, why))
            hit = saved.lookup_once(self.kernel, key)
            if hit is not None and self._path.accept_saved(key, hit[0]):
                self.loaded += 1
                v = self._settle(self._path.verdict(key, hit[0], hit[1] or "saved verdict", timing=hit[2]))
        return v

    def put(self, v: Verdict) -> Verdict:
        """Store a verdict made here; returns the one to act on now (a pass held for the ranks reads as waiting)."""
        if self._persist:
            saved.save(self.kernel, v.key, v.ok, v.reason, v.timing)
        return self._settle(v)

    def _settle(self, v: Verdict) -> Verdict:
        if self._persist and agree.made(self, v):
            v = self._path.verdict(v.key, False, agree.WAITING)
        return self._mem.put(v.key, v)

    def release(self, v: Verdict) -> None:
        """The ranks agreed: a held pass takes effect (saved again when the agreed candidate differs)."""
        if self._persist and v.timing and v.timing.get("agreed"):
            saved.save(self.kernel, v.key, v.ok, v.reason, v.timing)
        self._mem.put(v.key, v)

    def refuse_from_peer(self, text: str, reason: str) -> bool:
        """Another rank refused the class ``text``: refuse it here too if this store holds it (True), never saved."""
        for key, v in self._mem.live().items():
            if saved.key_text(key) == text:
                if v.ok or v.reason == agree.WAITING:
                    self._mem.put(key, self._path.verdict(key, False, reason))
                return True
        return False

    def values(self) -> list[Verdict]:
        return self._mem.values()

    def clear(self) -> None:
        self._mem.clear()
        self.loaded = 0
        if self._persist:
            saved.ask_again(self.kernel)
            agree.forget(self.kernel)

    def __len__(self) -> int:
        return len(self._mem)


class KernelPath:
    """One verified kernel path; counts into its owner's ``stats`` and logs with ``label`` (the module docstring)."""

    kernel: ClassVar[str]
    candidates: ClassVar[tuple[Candidate, ...]] = ()
    #: saved on disk and agreed across ranks (False: kept in memory, e.g. a check of stock code on another route)
    persist: ClassVar[bool] = True

    def __init__(self, label: str, stats: Counter) -> None:
        self.label = label
        self.stats = stats
        self.guard = Guard(label, stats)
        #: per shape class: the check on the first real call of the class
        self.classes = VerdictStore(self.kernel, self, self.persist)
        #: per (device, dtype, ...): the first-use check on small inputs (:meth:`decide`)
        self.firsts = VerdictStore(self.kernel + ".toy", self, self.persist)

    def place(self, key: tuple) -> str:
        """The key in words, for logs and status."""
        return where(key)

    def accept_saved(self, key: tuple, ok: bool) -> bool:
        """Whether a saved verdict is taken as it is (False: the check runs again, e.g. under a stricter policy)."""
        return True

    def function(self) -> Callable[..., Any] | None:
        """The first candidate this torch_npu has, or None (no kernel here)."""
        mod = _backend.torch_npu_module()
        fns = (getattr(mod, c.op or c.name, None) for c in self.candidates)
        return next((fn for fn in fns if fn is not None), None)

    def verdict(self, key: tuple, ok: bool, reason: str, **facts: Any) -> Verdict:
        """A verdict of this kernel at ``key`` (``facts``: bitwise, errors, seconds)."""
        return Verdict(self.kernel, key, ok, reason, self.place(key), **facts)

    def call(
        self,
        key: tuple,
        run: Callable[[], T],
        check: Callable[[T], Verdict],
        scratch: Callable[[], int],
        device: torch.device,
        stock: Callable[[], Any] | None = None,
        more: Callable[[], tuple[tuple[str, Callable[[], T], Callable[[T], Verdict]], ...]] | None = None,
    ) -> T | None:
        """``run()`` where ``key`` may use the kernel, checked by ``check(out)`` on the first call of the class (after
        ``scratch()`` bytes were found free on ``device``), then timed against ``stock()``; ``more()``: further
        candidates (name, run, check), the fastest passing one wins the class. None: stock for this call."""
        known = self.classes.get(key)
        if (known is not None and not known.ok) or self.guard.waits(key):
            return None

        def attempt() -> T | None:
            first = self.candidates[0].name
            if known is not None:
                name = (known.timing or {}).get("candidate") or first
                return run() if name == first else {n: r for n, r, _ in more()}[name]()  # type: ignore[misc]
            alts = more() if more and timing.enabled() else ()  # untimed: no ground to prefer another candidate
            tried = {first: (run, check), **{n: (r, c) for n, r, c in alts}}
            if not self.guard.fits(key, device, scratch()):
                return None  # deferred: stock now, the check later
            outs, made = {}, {}
            for name, (r, c) in tried.items():
                try:
                    outs[name] = r()
                    made[name] = c(outs[name])
                except Exception as exc:
                    if is_error(exc) or name == first:
                        raise  # a fault of the class, or the first candidate's refusal (the guard's)
                    made[name] = self.verdict(key, False, f"the kernel raised {exc.__class__.__name__}: {exc}")
            self.stats["shape_checks"] += 1
            v = self._store(self.classes, self._timed(key, made, tried, stock, device))
            return outs[(v.timing or {}).get("candidate") or first] if v.ok else None

        ran, out, refusal = self.guard.run(key, attempt)
        if refusal:
            self._store(self.classes, self.verdict(key, False, refusal))
        return out if ran else None

    def _timed(self, key: tuple, made: dict[str, Verdict], tried: dict, stock: Any, device: torch.device) -> Verdict:
        """The class verdict from the candidates' checks, timed against ``stock`` where timing is on."""
        ok = [n for n, v in made.items() if v.ok]
        if not (ok and stock is not None and timing.enabled()):
            return next(iter(made.values()))  # untimed: the one candidate's check decides, as without timing
        stock_ms = timing.measure(stock, device)
        cands = {n: timing.measure(tried[n][0], device) if n in ok else None for n in made}
        self.stats["timings"] += len(ok) + 1
        t = timing.report(cands, stock_ms, list(made))
        t["refused"] = {n: v.reason[:200] for n, v in made.items() if not v.ok}
        v = made[t["candidate"]] if t["candidate"] else self.verdict(key, False, timing.slower(t))
        v.timing = t
        return v

    def decide(self, key: tuple, make: Callable[[], Verdict]) -> Verdict | None:
        """The first-use verdict at ``key``, made by ``make()`` under the guard and stored (None: a fault waits)."""
        v = self.firsts.get(key)
        if v is not None or self.guard.waits(key):
            return v
        ran, v, refusal = self.guard.run(key, make)
        if not (ran or refusal):
            return None
        return self._store(self.firsts, v if ran else self.verdict(key, False, refusal))

    def settled(self, key: tuple) -> bool | None:
        """The class verdict at ``key`` (ok), or None: not decided yet."""
        v = self.classes.get(key)
        return None if v is None else v.ok

    def why_stock(self, key: tuple) -> str:
        """Why ``key`` runs stock now, in words (for the fallback counters)."""
        v = self.classes.get(key)
        if v is not None and not v.ok:
            return "waiting for the other ranks" if v.reason == agree.WAITING else "shape class failed verification"
        f = self.guard.fault(key)
        if f is not None:
            return "check deferred (device memory)" if f.kind == "deferred" else "kernel fault (retried later)"
        return "stock"

    def _store(self, store: VerdictStore, v: Verdict) -> Verdict:
        (logger.info if v.ok else logger.warning)("vllm-omni-ascend-opt: %s: %s", self.label, v.describe())
        return store.put(v)

    def tally(self) -> dict[str, Any]:
        """How many shape classes use the kernel, how many are on stock and why (reason -> classes), and per class in
        use its candidate and ratio to stock (None: untimed)."""
        faults = self.guard.faults()
        waiting = {f.key for f in faults}
        verdicts = self.classes.values()
        why = Counter("refused: " + v.reason.split(";")[0] for v in verdicts if not v.ok)
        why.update(("demoted: " if f.demoted else "") + f.kind for f in faults)
        used = [v for v in verdicts if v.ok and v.key not in waiting]
        t = {v.place: v.timing or {} for v in used}
        in_use = {p: {"candidate": x.get("candidate") or self.candidates[0].name, "ratio": x.get("ratio")}
                  for p, x in t.items()}  # fmt: skip
        return {"kernel": len(used), "stock": sum(why.values()), "why": dict(why), "in_use": in_use}

    def notes(self) -> list[str]:
        """Every verdict and fault in words, and the tally line."""
        out = [v.describe() for v in (*self.firsts.values(), *self.classes.values())]
        out += [f"{self.kernel} fault: {f.describe()}" for f in self.guard.faults()]
        t = self.tally()
        why = "; ".join(f"{n} {w}" for w, n in t["why"].items())
        out.append(
            f"{self.kernel}: {t['kernel']} shape class(es) use the kernel, {t['stock']} on stock"
            + (f" ({why})" if why else "")
        )
        return out

    def clear(self) -> None:
        """Drop verdicts and faults (the owner's uninstall)."""
        self.guard.clear()
        self.classes.clear()
        self.firsts.clear()
