"""A fault (the fake's FaultPlan) costs one kernel call, never a request: stock for that call, status names it, and
the next forward is as without it (``blocks/kernels/guard.py``)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from tests.harness.forward import tiny_forward
from tests.harness.stock import stock_then
from vllm_omni_ascend_opt import _report, api
from vllm_omni_ascend_opt.blocks.kernels import rope_tables, saved
from vllm_omni_ascend_opt.opts import fused_attention as fa
from vllm_omni_ascend_opt.opts import qk_norm as qn
from vllm_omni_ascend_opt.opts import rope


@pytest.fixture(autouse=True)
def _no_saved_verdicts(monkeypatch):
    monkeypatch.setenv(saved.ENV_VERDICT_CACHE, "off")  # saved verdicts would skip the checks the faults aim at


# (optimization, spec, kernel, call to fault, kind, is the kernel bitwise stock on the fake in bf16)
POINTS = {
    "rope toy check": (rope.OPT, "none,+rope", "npu_rotary_mul", 1, "oom", False),
    "rope class check": (rope.OPT, "none,+rope", "npu_rotary_mul", 2, "runtime", False),
    "rope in use": (rope.OPT, "none,+rope", "npu_rotary_mul", 5, "oom", False),
    "qk_norm class check": (qn.OPT, "none,+qk_norm", "npu_rms_norm", 1, "oom", True),
    "qk_norm in use": (qn.OPT, "none,+qk_norm", "npu_rms_norm", 6, "runtime", True),
    "fused_attention toy check": (fa.OPT, "none,+fused_attention", "npu_fusion_attention", 2, "oom", False),
    "fused_attention class check": (fa.OPT, "none,+fused_attention", "npu_fusion_attention", 3, "oom", False),
    "fused_attention in use": (fa.OPT, "none,+fused_attention", "npu_fusion_attention", 5, "runtime", False),
}
KIND_WORDS = {"oom": "out of memory", "runtime": "runtime error"}


@pytest.mark.parametrize("point", list(POINTS))
def test_a_fault_costs_one_call_and_the_next_forward_is_as_without_it(fake_npu, runtime, bf16_transformer, point):
    opt, spec, kernel, at, kind, bitwise = POINTS[point]
    fake_npu()
    stock = stock_then(spec, bf16_transformer, lambda: tiny_forward(runtime, bf16_transformer))
    clean = tiny_forward(runtime, bf16_transformer)  # the default run, no fault
    npu = fake_npu()  # a new backend probe: every verdict is made afresh
    npu.faults.inject(kernel, at=at, kind=kind)
    faulted = tiny_forward(runtime, bf16_transformer)  # 1. completes
    assert npu.faults.fired == {kernel: 1}
    if bitwise:
        assert torch.equal(faulted, stock) and torch.equal(clean, stock)
    else:  # stock for the faulted call, the kernel elsewhere: between the two
        assert torch.isfinite(faulted).all() and (faulted.float() - clean.float()).abs().max() <= 2.0**-4
        if at == 1:  # the toy check faulted: no call of this forward took the kernel
            assert torch.equal(faulted, stock)
    path = opt.rotary if opt is rope.OPT else opt.path
    (fault,) = path.guard.faults()  # 3. status names it
    assert fault.kind == KIND_WORDS[kind] and "fake fault" in fault.error and not fault.demoted
    assert any(KIND_WORDS[kind] in n for n in opt.notes())
    assert opt.kernel_classes()["why"] == {KIND_WORDS[kind]: 1}
    assert _report.status_report()["kernels"][opt.name]["why"] == {KIND_WORDS[kind]: 1}
    assert not opt.reasons_inactive(bf16_transformer)  # a fault is not "off"
    again = tiny_forward(runtime, bf16_transformer)  # 2. the next forward: the kernel is back, as without the fault
    assert torch.equal(again, clean)
    verdicts = path.firsts.values() + path.classes.values()
    assert path.guard.faults() == [] and all(v.ok for v in verdicts) and opt.stats["recovered"] == 1
    assert opt.kernel_classes()["stock"] == 0


def test_a_fault_while_building_tables_leaves_no_partial_entry(fake_npu, monkeypatch):
    npu = fake_npu()
    monkeypatch.setattr(rope_tables, "torch", npu.faults.proxy(torch, "stack"))
    npu.faults.inject("stack", at=1, kind="oom")
    freqs = torch.polar(torch.ones(5, 4), torch.rand(5, 4))
    t = rope_tables.Tables(torch.float32)
    with pytest.raises(RuntimeError, match="out of memory"):
        rope_tables.portable_tables(t, freqs, Counter())
    assert t.cos is None and t.sin_signed is None  # neither half stored
    cos, sin_signed = rope_tables.portable_tables(t, freqs, Counter())
    assert cos is t.cos and sin_signed is t.sin_signed and sin_signed is not None


def test_a_table_fault_on_the_kernel_path_costs_one_call(fake_npu, runtime, bf16_transformer, monkeypatch):
    """Inside the guarded kernel call: that rotation runs the portable path; next forward: the kernel, whole tables."""
    fake_npu()
    api.select("none,+rope", model=bf16_transformer)
    clean = tiny_forward(runtime, bf16_transformer)
    npu = fake_npu()
    rope.OPT.rotary.tables.clear()  # built afresh in the faulted forward
    monkeypatch.setattr(rope_tables, "torch", npu.faults.proxy(torch, "repeat_interleave"))
    npu.faults.inject("repeat_interleave", at=4, kind="oom")  # while building the NPU sin table of a real call
    faulted = tiny_forward(runtime, bf16_transformer)
    assert torch.isfinite(faulted).all() and (faulted.float() - clean.float()).abs().max() <= 2.0**-4
    assert npu.faults.fired == {"repeat_interleave": 1}
    assert [f.kind for f in rope.OPT.rotary.guard.faults()] == ["out of memory"]
    for tables in rope.OPT.rotary.tables._entries.values():  # no half-built form
        assert (tables.cos is None) == (tables.sin_signed is None)
        assert (tables.npu_cos is None) == (tables.npu_sin is None)
    calls = rope.OPT.stats["kernel_calls"]
    assert torch.equal(tiny_forward(runtime, bf16_transformer), clean) and rope.OPT.stats["kernel_calls"] > calls
    assert rope.OPT.rotary.guard.faults() == []


def test_a_check_that_does_not_fit_in_free_memory_is_deferred_not_failed(fake_npu, runtime, bf16_transformer):
    """A check whose fp32 scratch exceeds the free memory runs stock, deferred (no verdict, no error) till it fits."""
    npu = fake_npu()
    stock = stock_then("none,+qk_norm", bf16_transformer, lambda: tiny_forward(runtime, bf16_transformer))
    npu.memory["free"] = 1024
    assert torch.equal(tiny_forward(runtime, bf16_transformer), stock)
    assert qn.OPT.verdicts() == [] and qn.OPT.stats["kernel_calls"] == 0 and qn.OPT.stats["deferred_checks"] > 0
    faults = qn.OPT.path.guard.faults()
    assert faults and all(f.kind == "deferred" and f.errors == 0 for f in faults)
    assert any("check deferred (needs" in n and "MiB free" in n for n in qn.OPT.notes())
    assert 0 < qn.OPT.path.guard.scratch_peak
    npu.memory["free"] = 64 << 30
    assert torch.equal(tiny_forward(runtime, bf16_transformer), stock)
    assert qn.OPT.verdicts() and all(v.ok for v in qn.OPT.verdicts()) and qn.OPT.stats["kernel_calls"] > 0
