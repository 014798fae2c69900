"""The peak-memory probe (testbed/memory.py) against cases computed by hand."""

from __future__ import annotations

import torch

from vllm_omni_ascend_opt.testbed.memory import measure

N = 1 << 20  # floats: 4 MiB per tensor
SLACK = 4096  # the profiler's own scalars


def _two_step(x: torch.Tensor) -> torch.Tensor:
    t = x * 2  # +4 MiB
    out = t + 1  # +4 MiB while t is alive: the peak
    del t  # -4 MiB
    return out


def _in_place(x: torch.Tensor) -> torch.Tensor:
    out = x * 2  # +4 MiB
    out.add_(1)  # no allocation
    return out


def test_peak_and_end_of_a_two_step_computation():
    x = torch.randn(N)  # allocated before the call: not counted
    out, m = measure(_two_step, x)
    assert torch.equal(out, x * 2 + 1)
    assert 8 * N <= m.peak <= 8 * N + SLACK
    assert 4 * N <= m.end <= 4 * N + SLACK
    assert m.allocations >= 2


def test_in_place_halves_the_peak():
    x = torch.randn(N)
    _, two = measure(_two_step, x)
    _, one = measure(_in_place, x)
    assert 4 * N <= one.peak <= 4 * N + SLACK
    assert one.peak < two.peak
