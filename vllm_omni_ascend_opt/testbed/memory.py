"""Peak memory of one call: the bytes of tensor storage allocated during it and alive at its worst moment.

On CPU, the running sum of the profiler's signed ``[memory]`` events: its maximum the peak, its last value ``end``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any
from unittest import mock

import torch


@dataclass(frozen=True)
class MemoryPeak:
    """Bytes allocated by one call: at its worst moment (``peak``), and still alive when it returned (``end``)."""

    peak: int
    end: int
    allocations: int


def measure(fn: Callable[..., Any], *args: Any, device: str = "cpu", **kwargs: Any) -> tuple[Any, MemoryPeak]:
    """``fn(*args, **kwargs)``'s result and :class:`MemoryPeak` on ``device`` (on an accelerator, its allocator's peak
    over what was allocated before, ``allocations`` 0: unknown)."""
    kind = torch.device(device).type
    acc = getattr(torch, kind, None) if kind != "cpu" else None
    if acc is not None and callable(getattr(acc, "max_memory_allocated", None)):
        acc.synchronize()
        acc.reset_peak_memory_stats()
        before = acc.memory_allocated()
        out = fn(*args, **kwargs)
        acc.synchronize()
        return out, MemoryPeak(acc.max_memory_allocated() - before, acc.memory_allocated() - before, allocations=0)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn(*args, **kwargs)
    events = sorted(
        (e.start_ns(), e.nbytes())
        for e in prof.profiler.kineto_results.events()
        if e.name() == "[memory]" and str(e.device_type()).rsplit(".", 1)[-1].lower() == kind
    )
    live = peak = 0
    for _t, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return out, MemoryPeak(peak=peak, end=live, allocations=sum(1 for _t, n in events if n > 0))


@contextlib.contextmanager
def first_call_peaks(targets: dict[str, tuple[Any, str]], device: str = "cpu") -> Iterator[dict[str, MemoryPeak]]:
    """While active, the first call of each ``obj.method`` (``label -> (obj, method)``, hooks included) runs under
    :func:`measure`; the yielded dict fills with ``label -> MemoryPeak``."""
    peaks: dict[str, MemoryPeak] = {}

    def wrap(label: str, current: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if label in peaks:
                return current(*args, **kwargs)
            out, peaks[label] = measure(current, *args, device=device, **kwargs)
            return out

        return wrapper

    with contextlib.ExitStack() as patches:
        for label, (obj, method) in targets.items():
            patches.enter_context(mock.patch.object(obj, method, wrap(label, getattr(obj, method))))
        yield peaks


def pipeline_targets(pipe: Any) -> dict[str, tuple[Any, str]]:
    """The calls whose peaks the benchmarks and the ablation report show, those ``pipe`` has."""
    out = {}
    for label, attr, method in (("transformer_forward", "transformer", "forward"), ("vae_decode", "vae", "decode")):
        obj = getattr(pipe, attr, None)
        if obj is not None and callable(getattr(obj, method, None)):
            out[label] = (obj, method)
    return out


def mib(nbytes: int | None) -> str:
    """``nbytes`` in MiB for tables ("–" for None)."""
    return "–" if nbytes is None else f"{nbytes / 2**20:.1f}"


def ratio(nbytes: int | None, stock: int | None) -> str:
    """``nbytes / stock`` for tables ("–" when either is unknown or stock is 0)."""
    return "–" if nbytes is None or not stock else f"{nbytes / stock:.3f}"
