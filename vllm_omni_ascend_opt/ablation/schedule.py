"""The order in which an ablation run starts and measures its configurations, interleaved so that drift of the
machine hits all of them alike: ``resident`` (:func:`step_order`, :func:`process_sets`) and ``per-round``
(:func:`rotation`), as docs/ablation.md ("How the measurement stays honest") describes.
"""

from __future__ import annotations

from typing import Any, TypeVar

from vllm_omni_ascend_opt.ablation.plan import Plan

T = TypeVar("T")
#: (configuration id, round) -> the (prompt, seed) samples measured for it.
Measured = dict[tuple[str, int], set[tuple[int, int]]]


def measured(records: list[dict[str, Any]]) -> Measured:
    """The measured (not warm-up) samples in ``records``, per (configuration, round)."""
    out: Measured = {}
    for r in records:
        if r.get("type") == "sample" and not r.get("warmup"):
            out.setdefault((r["config"], r["round"]), set()).add((r["prompt"], r["seed"]))
    return out


def williams_orders(n: int) -> list[list[int]]:
    """Orders of ``n`` configurations (a Williams design): each index stands at each position, and directly follows
    each other index, equally often (n orders for even n; for odd n each order and its reverse, 2n)."""
    if n <= 1:
        return [list(range(n))]
    first, lo, hi = [0], 1, n - 1
    while len(first) < n:
        first.append(lo)
        lo += 1
        if len(first) < n:
            first.append(hi)
            hi -= 1
    rows = [[(x + i) % n for x in first] for i in range(n)]
    if n % 2:
        rows += [row[::-1] for row in rows]
    return rows


def step_order(live: list[T], step: int) -> list[T]:
    """``live`` in the Williams order of measuring step ``step`` (round x samples + sample)."""
    rows = williams_orders(len(live))
    return [live[i] for i in rows[step % len(rows)]]


def process_sets(repeats: int, sets: int) -> list[list[int]]:
    """The rounds split into ``sets`` consecutive blocks, each measured by freshly started workers."""
    n, k = repeats, max(1, min(sets, repeats))
    bounds = [round(i * n / k) for i in range(k + 1)]
    return [list(range(bounds[i], bounds[i + 1])) for i in range(k)]


def start_order(configs: list[T], set_index: int) -> list[T]:
    """Every other process set starts its workers in reverse: workers started earlier can run slower."""
    return list(reversed(configs)) if set_index % 2 == 1 else list(configs)


def rotation(configs: list[T], rnd: int) -> list[T]:
    """The per-round schedule's order in round ``rnd``: the configurations rotated by the round."""
    shift = rnd % len(configs)
    return configs[shift:] + configs[:shift]


def todo(plan: Plan, records: list[dict[str, Any]], failed: set[str] | dict[str, Any]) -> Measured:
    """(configuration, round) -> the samples still to measure, for every configuration not in ``failed``."""
    have = measured(records)
    out: Measured = {}
    for c in plan.configs:
        if c.id in failed:
            continue
        for rnd in range(plan.workload.repeats):
            left = set(plan.samples) - have.get((c.id, rnd), set())
            if left:
                out[(c.id, rnd)] = left
    return out
