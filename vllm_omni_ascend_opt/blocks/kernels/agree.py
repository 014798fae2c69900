"""Ranks agree on every kernel verdict: a shape class refused on any rank is refused on all (a logical AND).

Each rank checks a class on its own data (SP shards, CFG branches), so a kernel wrong only on some inputs could pass
on one rank and fail on another. The verdicts a rank makes (:func:`made`; a pass is held back meanwhile) are exchanged
at the end of each outermost transformer forward (:func:`sync`, the one point every rank reaches equally often) over
a CPU (gloo) group (:func:`_cpu_group`; over HCCL it would synchronize the stream): a refusal anywhere replaces a pass
everywhere, or waits for a class not met yet (:func:`peer_refusal`); passes of one class from several ranks run
the candidate :func:`.timing.agreed` picks from everyone's timings (stock when none passed and beat it on every rank).
"""

from __future__ import annotations

import dataclasses
import logging
import weakref
from typing import Any

from vllm_omni_ascend_opt.blocks.kernels import saved, timing
from vllm_omni_ascend_opt.blocks.upstream import forward_scope

logger = logging.getLogger("vllm_omni_ascend_opt")

#: kernel name -> the kernel paths of that kernel in this process (weakly)
_PATHS: dict[str, weakref.WeakSet[Any]] = {}
#: verdicts made on this rank since the last sync: (kernel, key text, ok, reason, timing)
_PENDING: list[tuple[str, str, bool, str, Any]] = []
#: passes made here in the current forward, held back until the ranks agree: (path, verdict)
_HELD: list[tuple[Any, Any]] = []
#: refusals from peers for classes no path here holds yet: kernel -> key text -> reason
_REMOTE: dict[str, dict[str, str]] = {}


def register(path: Any) -> None:
    _PATHS.setdefault(path.kernel, weakref.WeakSet()).add(path)


def made(store: Any, v: Any) -> bool:
    """A verdict ``store`` just made (or took from disk), agreed at the next :func:`sync`; under several ranks a pass
    is held back until then (the path runs stock meanwhile): True if held."""
    if _group_size() <= 1:
        return False
    _PENDING.append((store.kernel, saved.key_text(v.key), v.ok, v.reason, v.timing))
    if v.ok:
        _HELD.append((store, v))
    return v.ok


def peer_refusal(kernel: str, key: Any) -> str | None:
    """Another rank's refusal of ``key`` that no path here had met yet, or None."""
    return _REMOTE.get(kernel, {}).get(saved.key_text(key)) if _REMOTE else None


def forget(kernel: str) -> None:
    """Drop what this module holds for ``kernel`` (its path was cleared, or the backend probe changed)."""
    _REMOTE.pop(kernel, None)
    _HELD[:] = [(p, v) for p, v in _HELD if p.kernel != kernel]


#: the reason a class takes the stock path while its pass waits for the other ranks (:func:`made`)
WAITING = "checked here; waiting for the other ranks' verdicts (end of this forward)"


def _group_size() -> int:
    try:
        import torch.distributed as dist

        return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    except Exception:
        return 1


def sync() -> int:
    """Exchange this rank's new verdicts with the other ranks and apply their refusals; returns how many refusals
    from peers changed or pre-empted a verdict here. A no-op (no collective) without a multi-rank group."""
    if _group_size() <= 1:
        _PENDING.clear()
        _release_held()
        return 0
    import torch.distributed as dist

    mine, _PENDING[:] = list(_PENDING), []
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine, group=_cpu_group())
    me, changed = dist.get_rank(), 0
    passes: dict[tuple[str, str], list[Any]] = {}
    for rank, verdicts in enumerate(everyone):
        for name, text, ok, reason, t in verdicts or ():
            if ok and t:
                passes.setdefault((name, text), []).append(t)
            if ok or rank == me:
                continue
            why = f"refused on rank {rank}: {reason}"
            _HELD[:] = [(p, v) for p, v in _HELD if not (p.kernel == name and saved.key_text(v.key) == text)]
            met = [p.refuse_from_peer(text, why) for p in list(_PATHS.get(name, ()))]
            if not any(met):
                _REMOTE.setdefault(name, {})[text] = why
            changed += 1
    if changed:
        logger.warning("vllm-omni-ascend-opt: %d kernel verdict(s) refused on another rank apply here too", changed)
    _HELD[:] = [(p, _agreed(p, v, passes.get((p.kernel, saved.key_text(v.key)), []))) for p, v in _HELD]
    _release_held()
    return changed


def _agreed(store: Any, v: Any, timings: list[Any]) -> Any:
    """The held pass ``v`` running the candidate every rank agrees on (the timings the ranks reported for it)."""
    if len(timings) < 2 or not v.timing:
        return v
    choice = timing.agreed(timings, [c.name for c in store._path.candidates])
    if choice == v.timing.get("candidate"):
        return v
    if choice is None:
        return store._path.verdict(v.key, False, "no candidate passed and beat stock on every rank", timing=v.timing)
    t = {**v.timing, "candidate": choice, "kernel_ms": v.timing["candidates"][choice], "agreed": True}
    t["ratio"] = round(t["kernel_ms"] / t["stock_ms"], 4) if t["stock_ms"] and t["kernel_ms"] is not None else None
    return dataclasses.replace(v, timing=t, reason=f"{v.reason}; ranks agreed on {choice}")


#: id of the default process group -> the CPU group verdicts are exchanged over (None: the default one, gloo already)
_CPU_GROUPS: dict[int, Any] = {}


def _cpu_group() -> Any:
    """A gloo group of every rank: vLLM's world CPU group, else the default group if gloo, else a new gloo group."""
    import torch.distributed as dist

    key = id(dist.group.WORLD)
    if key not in _CPU_GROUPS:
        try:
            from vllm.distributed import parallel_state

            world = parallel_state.get_world_group()
            group = world.cpu_group if world.world_size == dist.get_world_size() else None
        except Exception:  # no vLLM world group in this process
            group = None
        if group is None and dist.get_backend() != "gloo":
            group = dist.new_group(backend="gloo")  # collective: every rank asks at the same forward end
        _CPU_GROUPS[key] = group
    return _CPU_GROUPS[key]


def _release_held() -> None:
    """The ranks have agreed: the passes held back in this forward take effect."""
    held, _HELD[:] = list(_HELD), []
    for path, verdict in held:
        path.release(verdict)


forward_scope.at_forward_end(sync)
