"""Verified faster, not only correct: each candidate that passed its check is timed against stock on the same inputs.

On the first call of a shape class, after the check, :func:`measure` times stock and each passing candidate on the
device. The fastest candidate wins the class if its median is at least ``$VLLM_OMNI_ASCEND_OPT_MIN_GAIN_PCT``
(default 2) below stock's; else the class is refused, "slower: kernel X ms, stock Y ms" (a verdict, saved like the
others). ``$VLLM_OMNI_ASCEND_OPT_TIMING=0``: correctness only (the first passing candidate). Across ranks,
:func:`agreed` picks the same candidate on every rank from the gathered reports.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from vllm_omni_ascend_opt import _env

ENV_TIMING = "VLLM_OMNI_ASCEND_OPT_TIMING"
ENV_MIN_GAIN = "VLLM_OMNI_ASCEND_OPT_MIN_GAIN_PCT"
WARMUPS, REPEATS = 2, 5


def enabled() -> bool:
    return _env.boolean(ENV_TIMING, True)


def min_gain_pct() -> float:
    try:
        pct = float(os.environ.get(ENV_MIN_GAIN, "") or 2.0)
    except ValueError:
        pct = 2.0
    return _env.check_range(ENV_MIN_GAIN, pct, 0.0, 50.0, "%")


def faster(ms: float | None, stock_ms: float | None) -> bool:
    """Whether ``ms`` (None: refused by its check) beats ``stock_ms`` by the margin."""
    return ms is not None and stock_ms is not None and ms <= stock_ms * (1.0 - min_gain_pct() / 100.0)


def measure(fn: Callable[[], Any], device: torch.device) -> float:
    """Median ms of :data:`REPEATS` calls after :data:`WARMUPS` (NPU event pairs, else a synchronised host timer)."""
    npu = getattr(torch, "npu", None)
    event = getattr(npu, "Event", None)
    sync = getattr(npu, "synchronize", None) or (lambda: None)
    for _ in range(WARMUPS):
        fn()
    times = []
    for _ in range(REPEATS):
        if event is not None:
            start, end = event(enable_timing=True), event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(float(start.elapsed_time(end)))
        else:
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            times.append((time.perf_counter() - t0) * 1e3)
    return round(float(statistics.median(times)), 4)  # 0.1 µs: below what an event resolves


def report(cands: dict[str, float | None], stock_ms: float | None, order: Sequence[str]) -> dict[str, Any]:
    """The timing saved with a verdict: each candidate's ms (None: refused by its check), stock's, and the choice."""
    best = choose([{**cands, "stock": stock_ms}], order)
    ms = cands.get(best) if best else min((v for v in cands.values() if v is not None), default=None)
    ratio = round(ms / stock_ms, 4) if ms is not None and stock_ms else None
    return {"candidate": best, "kernel_ms": ms, "stock_ms": stock_ms, "ratio": ratio, "repeats": REPEATS,
            "candidates": dict(cands)}  # fmt: skip


def choose(reports: Sequence[dict[str, float | None]], order: Sequence[str]) -> str | None:
    """The candidate every report (``{candidate: ms or None, "stock": ms}``) passed and found faster than its own
    stock, with the least worst-case ms (ties: ``order``); None: stock."""
    ok = [c for c in order if all(faster(r.get(c), r.get("stock")) for r in reports)]
    return min(ok, key=lambda c: (max(float(r[c] or 0.0) for r in reports), order.index(c)), default=None)


def agreed(timings: Sequence[dict[str, Any]], order: Sequence[str]) -> str | None:
    """The candidate all ranks run, from every rank's saved timing (each rank's margin against its own stock)."""
    return choose([{**t["candidates"], "stock": t["stock_ms"]} for t in timings], order)


def slower(t: dict[str, Any]) -> str:
    """The refusal of a class whose candidates passed but none beat stock."""
    return f"slower: kernel {t['kernel_ms']:.4g} ms, stock {t['stock_ms']:.4g} ms (needs {min_gain_pct():g}% less)"
