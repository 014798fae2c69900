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


def test_peak_and_end_of_a_two_step_computation_and_in_place_halves_the_peak():
    x = torch.randn(N)  # allocated before the call: not counted
    out, m = measure(_two_step, x)
    assert torch.equal(out, x * 2 + 1)
    assert 8 * N <= m.peak <= 8 * N + SLACK
    assert 4 * N <= m.end <= 4 * N + SLACK
    assert m.allocations >= 2
    _, one = measure(_in_place, x)
    assert 4 * N <= one.peak <= 4 * N + SLACK
    assert one.peak < m.peak


class _Allocates(torch.nn.Module):
    def forward(self, n: int) -> torch.Tensor:
        return _two_step(torch.zeros(n))  # +4n bytes for the input, then 8n more at the peak: 12n


def test_first_call_peaks_measures_only_the_first_call_and_restores_the_method_of_the_pipeline_targets():
    from types import SimpleNamespace

    from vllm_omni_ascend_opt.testbed.memory import first_call_peaks, pipeline_targets

    m = _Allocates()
    bound = m.forward
    with first_call_peaks({"fwd": (m, "forward")}) as peaks:
        assert peaks == {}
        m(N)  # measured: 12 N floats at the peak
        m(4 * N)  # not measured (four times larger)
    assert 12 * N <= peaks["fwd"].peak <= 12 * N + SLACK  # the first call, not the larger second one
    assert "forward" not in vars(m) and m.forward == bound  # no instance attribute left behind

    def instance_forward(n: int) -> torch.Tensor:
        return torch.zeros(n)

    m.forward = instance_forward  # e.g. a hook registry's forward wrapper: wrapped, then put back by identity
    with first_call_peaks({"fwd": (m, "forward")}) as peaks:
        m(N)
    assert 4 * N <= peaks["fwd"].peak <= 4 * N + SLACK
    assert vars(m)["forward"] is instance_forward
    tr, vae = _Allocates(), SimpleNamespace(decode=lambda z: z)
    assert pipeline_targets(SimpleNamespace(transformer=tr, vae=vae)) == {
        "transformer_forward": (tr, "forward"),
        "vae_decode": (vae, "decode"),
    }
    assert pipeline_targets(SimpleNamespace(transformer=tr)) == {"transformer_forward": (tr, "forward")}
