"""Ranks agree on every kernel verdict: a shape class refused on any rank is refused on all (a logical AND).

Why: each rank checks a class on its own data (SP shards, CFG branches), and a kernel that is wrong only on some
inputs or some cards could pass on one rank and fail on another; the ranks of one image would then run different
kernels. So the verdicts a rank makes are exchanged with the others through the default process group, and a refusal
anywhere replaces a pass everywhere (for a class a rank has not met yet, at its first lookup). A pass is held back
until then: in the forward that checked it, the class takes the stock path on every rank.

When: at the end of each outermost transformer forward (:func:`sync`, called by ``forward_scope`` on close), the one
point every rank of vLLM-Omni's parallel modes reaches the same number of times (each step runs the transformer
once per rank), never in the middle of a forward where ranks may meet different shape classes (CFG-parallel
branches with different prompt lengths). Cost: one ``all_gather_object`` of the new verdicts per forward, only when
a process group of more than one rank exists, over a CPU (gloo) group (:func:`_cpu_group`): on a device backend
(HCCL) it would move the pickled verdicts through device memory and synchronize the stream at every step. So the ranks run the same kernels in every forward: stock for a class
in the forward that checks it (or reads its pass from disk), the agreed verdict afterwards.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any

from vllm_omni_ascend_opt.blocks.upstream import forward_scope

logger = logging.getLogger("vllm_omni_ascend_opt")

#: cache name -> the caches of that kernel in this process (weakly)
_CACHES: dict[str, weakref.WeakSet[Any]] = {}
#: verdicts made on this rank since the last sync: (cache name, key text, ok, reason)
_PENDING: list[tuple[str, str, bool, str]] = []


def register(cache: Any) -> None:
    _CACHES.setdefault(cache.name, weakref.WeakSet()).add(cache)


def made(cache: Any, key: Any, ok: bool, reason: str) -> None:
    """A verdict this rank just made (or took from disk): to be agreed at the next :func:`sync`."""
    from vllm_omni_ascend_opt.blocks.kernels import saved

    if _group_size() > 1:
        _PENDING.append((cache.name, saved.key_text(key), ok, reason))


#: the reason a class takes the stock path while its pass waits for the other ranks (:meth:`VerdictCache._hold`)
WAITING = "checked here; waiting for the other ranks' verdicts (end of this forward)"


def multi_rank() -> bool:
    """Whether verdicts must be agreed with other ranks (a process group of more than one rank exists)."""
    return _group_size() > 1


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
    for rank, verdicts in enumerate(everyone):
        if rank == me:
            continue
        for name, text, ok, reason in verdicts or ():
            if ok:
                continue
            for cache in list(_CACHES.get(name, ())):
                cache.refuse_from_peer(text, f"refused on rank {rank}: {reason}")
                changed += 1
    if changed:
        logger.warning("vllm-omni-ascend-opt: %d kernel verdict(s) refused on another rank apply here too", changed)
    _release_held()
    return changed


#: id of the default process group -> the CPU group verdicts are exchanged over (None: the default one, gloo already)
_CPU_GROUPS: dict[int, Any] = {}


def _cpu_group() -> Any:
    """A gloo group of every rank, made once per default group: vLLM's world CPU group when vLLM set one up, the
    default group when it is gloo already, else a new gloo group (every rank asks at the same forward end, as
    ``new_group`` requires)."""
    import torch.distributed as dist

    key = id(dist.group.WORLD)
    if key not in _CPU_GROUPS:
        group = None
        try:
            from vllm.distributed import parallel_state

            world = parallel_state.get_world_group()
            if world.world_size == dist.get_world_size():
                group = world.cpu_group
        except Exception:  # no vLLM world group in this process
            group = None
        if group is None and dist.get_backend() != "gloo":
            group = dist.new_group(backend="gloo")
        _CPU_GROUPS[key] = group
    return _CPU_GROUPS[key]


def _release_held() -> None:
    for caches in _CACHES.values():
        for cache in list(caches):
            cache.release_held()


forward_scope.at_forward_end(sync)
