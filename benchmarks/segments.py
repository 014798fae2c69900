"""Host time per segment of a transformer forward: before the first block, each block, after the last.

Why: the 2-block forward of ``bench_host.py`` mixes per-block work with the forward's fixed work (the input
projections, the time embedding, RoPE, ``norm_out``, ``proj_out``) and with per-forward decisions that the first
block pays. Deriving the split from two depths ((12-block - 2-block) / 10) assumes every block costs the same at both
depths, which caches and the first block's decisions do not honour. Timing the segments inside one forward measures
them directly.

How: the transformer's ``transformer_blocks`` ModuleList gets a subclass whose ``__iter__`` reads the thread's CPU
clock before it hands out each block and after the last one (a ``__class__`` swap for the measurement: the same
object and blocks, so nothing the plugin keyed on changes; restored afterwards). vLLM-Omni's forward iterates that
list once per forward, so the marks split the forward into ``before``, one segment per block and ``after``. The clock
reads cost the same in every configuration.
"""

from __future__ import annotations

import contextlib
import itertools
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch.nn as nn


class TimedBlocks(nn.ModuleList):
    """A ModuleList that records ``time.thread_time_ns()`` in :attr:`marks` before each block it yields and after
    the last one."""

    marks: list[int]

    def __iter__(self) -> Iterator[nn.Module]:
        marks = self.__dict__.setdefault("marks", [])
        for block in super().__iter__():
            marks.append(time.thread_time_ns())
            yield block
        marks.append(time.thread_time_ns())


@contextlib.contextmanager
def timed_blocks(transformer: nn.Module) -> Iterator[TimedBlocks]:
    """``transformer.transformer_blocks`` as a :class:`TimedBlocks` while the context lasts (same object)."""
    blocks = transformer.transformer_blocks
    original = type(blocks)
    blocks.__class__ = type("TimedBlocks", (TimedBlocks, original), {})
    blocks.__dict__["marks"] = []
    try:
        yield blocks  # type: ignore[misc]
    finally:
        blocks.__class__ = original
        blocks.__dict__.pop("marks", None)


def segments_ns(blocks: TimedBlocks, forward: Callable[[], Any]) -> list[int]:
    """Thread CPU nanoseconds of one ``forward()``: ``[before, block 1, ..., block N, after]``."""
    marks = blocks.marks
    marks.clear()
    t0 = time.thread_time_ns()
    forward()
    t1 = time.thread_time_ns()
    if len(marks) < 2:
        raise RuntimeError("the forward did not iterate transformer_blocks once")
    return [marks[0] - t0, *(b - a for a, b in itertools.pairwise(marks)), t1 - marks[-1]]


def summarize(samples: list[list[int]]) -> dict[str, float]:
    """Medians in microseconds of ``segments_ns`` samples: before, first block, later blocks (median per block),
    after, and the total (the sum of the segment medians)."""
    cols = [statistics.median(c) / 1e3 for c in zip(*samples, strict=True)]
    later = cols[2:-1]
    out = {
        "before": cols[0],
        "first_block": cols[1],
        "later_block": statistics.median(later) if later else float("nan"),
        "after": cols[-1],
        "blocks": len(cols) - 2,
    }
    out["total"] = sum(cols)
    return out


def measure(
    transformer: nn.Module, rt: Any, kw: dict[str, Any], configs: dict[str, str], rounds: int, warm: int
) -> dict[str, dict[str, float]]:
    """Per configuration (name -> flags, stock first), :func:`summarize` of ``rounds`` interleaved rounds of one
    cold forward after switching and ``warm`` timed warm forwards (under ``rt.context()`` and ``inference_mode``, as
    vLLM-Omni's runner); the transformer is left with no optimization selected."""
    import torch

    from vllm_omni_ascend_opt import api

    samples: dict[str, list[list[int]]] = {name: [] for name in configs}
    with timed_blocks(transformer) as blocks, rt.context(), torch.inference_mode():
        for _ in range(rounds):
            for name, flags in configs.items():
                api.select(flags, model=transformer)
                transformer(**kw)  # switching drops the memo: one cold forward first
                samples[name] += [segments_ns(blocks, lambda: transformer(**kw)) for _ in range(warm)]
    api.select("none", model=transformer)
    return {name: summarize(s) for name, s in samples.items()}


COLUMNS = ("before", "first_block", "later_block", "after", "total")


def report(rows: dict[str, dict[str, float]], header: str) -> list[str]:
    """The table: per configuration, each segment's median µs and its ratio to stock's in the same run."""
    lines = [f"{header}; thread CPU us per segment (median), ratio to stock"]
    lines.append(f"  {'config':<18} " + " ".join(f"{c.replace('_', ' '):>18}" for c in COLUMNS))
    stock = rows["stock"]
    for name, r in rows.items():
        cells = " ".join(f"{r[c]:>8.1f} ({r[c] / stock[c]:.3f}x)" for c in COLUMNS)
        lines.append(f"  {name:<18} {cells}")
    return [
        *lines,
        "",
        "before = from the forward's call to its first block (input projections, RoPE, time embedding, the scope's",
        "opening); first block = block 1 with the forward's per-forward decisions; later block = the median of blocks",
        "2..N; after = norm_out, proj_out and the return; total = the sum of the segment medians.",
    ]
