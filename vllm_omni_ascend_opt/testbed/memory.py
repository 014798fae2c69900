"""Peak memory of one call, on CPU or any device the profiler sees: the bytes of tensor storage allocated during the
call and still alive at its worst moment.

Method: ``torch.profiler.profile(profile_memory=True)`` records every allocation and free of the allocators it
instruments as ``[memory]`` events with a signed byte count (positive: allocated, negative: freed). Summed in time
order, they give the live bytes the call added over what existed before it; the maximum of that running sum is the
peak. Storage that existed before the call (weights, inputs) is not counted; what the call returns is counted in
``end``. The profiler's own bookkeeping allocates a few scalars (bytes, not kilobytes). ``tests/test_memory_probe.py``
checks the method against hand-computed cases.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class MemoryPeak:
    """Bytes allocated by one call: at its worst moment (``peak``), and still alive when it returned (``end``)."""

    peak: int
    end: int
    allocations: int

    @property
    def peak_mib(self) -> float:
        return self.peak / 2**20


def measure(fn: Callable[..., Any], *args: Any, device: str = "cpu", **kwargs: Any) -> tuple[Any, MemoryPeak]:
    """``fn(*args, **kwargs)`` under the memory profiler: its result and the :class:`MemoryPeak` on ``device``."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if device != "cpu" and torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities, profile_memory=True, record_shapes=False) as prof:
        out = fn(*args, **kwargs)
    want = torch.device(device).type
    events = sorted(
        (e.start_ns(), e.nbytes())
        for e in prof.profiler.kineto_results.events()
        if e.name() == "[memory]" and str(e.device_type()).rsplit(".", 1)[-1].lower() == want
    )
    live = peak = 0
    for _t, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return out, MemoryPeak(peak=peak, end=live, allocations=sum(1 for _t, n in events if n > 0))
