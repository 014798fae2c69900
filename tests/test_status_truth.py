"""What the plugin reports is what it runs: the API's defaults, status under vLLM-Omni's runner (layerwise offload,
hooks), and the status file when the flag is bad."""

from __future__ import annotations

import json
import logging
import os

import pytest
import torch

from tests.harness.runner import loaded
from vllm_omni_ascend_opt import _plugin, _report, api, flags, registry
from vllm_omni_ascend_opt._state import STATE
from vllm_omni_ascend_opt.testbed.model_runner import RunnerHarness

SM, FAST_MOD = registry.get("shared_modulation"), registry.get("fast_modulate")


def test_apply_to_qwen_image_defaults_to_the_default_stack_and_switches_one_per_optimization():
    want = api.select("default")
    api.select("none")
    assert api.apply_to_qwen_image() == want
    assert STATE.selected == registry.default_names()  # joint_attention and qk_norm included
    assert api.accepted_keywords() == {o.name: o.default_enabled for o in registry.all_optimizations()}
    api.apply_to_qwen_image(joint_attention=False, vae_fast=True)
    want = (set(registry.default_names()) - {"joint_attention"}) | {"vae_fast"}
    assert STATE.selected == [n for n in registry.names() if n in want]
    with pytest.raises(TypeError, match=r"unknown optimization keyword.*bogus"):
        api.apply_to_qwen_image(bogus=True)


def _request(h: RunnerHarness) -> torch.Tensor:
    return h.generate(height=32, width=32, steps=2, cfg_scale=4.0)


def test_status_under_layerwise_offload_matches_what_runs(runtime):
    with loaded(runtime, "all", enable_layerwise_offload=True) as h:
        pipe = h.pipeline
        assert _report.explain(SM, pipe) == [] and _report.explain(FAST_MOD, pipe) == []  # between forwards
        _request(h)
        SM.reset_stats()
        FAST_MOD.reset_stats()
        _request(h)  # warm
        assert SM.stats["hits"] > 0 and SM.fallback_reasons() == {}, (dict(SM.stats), SM.fallback_reasons())
        assert FAST_MOD.ran() > 0  # the memoized block body ran, as reported
        assert "shared_modulation" in _report.acting(pipe) and "fast_modulate" in _report.acting(pipe)


def test_switch_on_a_pipeline_whose_hooks_captured_the_stock_block(runtime):
    """Layerwise offload's hooks captured the stock block forward at load: after the switch the projections are
    memoized (shared_modulation acts, with a note), the block body is not (fast_modulate says why)."""
    with loaded(runtime, "none", enable_layerwise_offload=True) as h:
        pipe = h.pipeline
        want = _request(h)
        api.select("default,+fast_modulate", model=pipe)
        assert _report.explain(SM, pipe) == []
        assert any("captured the block forward" in n for n in SM.model_notes(pipe))
        (why,) = [r for r in _report.explain(FAST_MOD, pipe) if "captured the block forward" in r]
        _request(h)
        SM.reset_stats()
        FAST_MOD.reset_stats()
        got = _request(h)
        assert SM.stats["hits"] > 0 and SM.fallback_reasons() == {}  # the projections come from the memo
        assert FAST_MOD.ran() == 0, why  # the stock block ran: the fast mode never did
        assert torch.equal(got, want)  # only exact optimizations acted (CPU: no torch_npu kernels)


def test_status_file_with_a_bad_flag_reports_after_build_and_every_request(monkeypatch, tmp_path, runtime):
    path = tmp_path / "status.json"
    monkeypatch.setenv(_report.ENV_STATUS_FILE, str(path))
    monkeypatch.setenv(flags.ENV_FLAG, "default,bogus")
    _plugin.register()
    st = json.loads(path.read_text())
    assert "bogus" in st["config_error"] and st["requests"] == 0 and "pipeline" not in st
    with loaded(runtime) as h:
        st = json.loads(path.read_text())
        assert st["pipeline"] == "QwenImagePipeline" and st["installed"] == [] and st["acting_on_pipeline"] == []
        assert st["pid"] == os.getpid() and st["requests"] == 0
        _request(h)
        _request(h)
        st = json.loads(path.read_text())
        assert st["requests"] == 2
        assert all(why == f"{flags.ENV_FLAG} is invalid, so nothing is patched" for why in st["off"].values())


def test_an_unwritable_status_file_warns_once_then_reminds(monkeypatch, tmp_path, caplog):
    """One warning (no traceback), then a rate-limited reminder with the count, and one line when it works again."""
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    monkeypatch.setenv(_report.ENV_STATUS_FILE, str(blocker / "status.json"))
    clock = [1000.0]
    monkeypatch.setattr(_report.time, "monotonic", lambda: clock[0])
    with caplog.at_level(logging.INFO, logger="vllm_omni_ascend_opt"):
        for _ in range(5):
            _report.write_status_file_safely()
        clock[0] += _report.STATUS_REMINDER_S
        _report.write_status_file_safely()
        monkeypatch.setenv(_report.ENV_STATUS_FILE, str(tmp_path / "status.json"))
        _report.write_status_file_safely()
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2 and all(r.exc_info is None for r in caplog.records)
    assert "cannot write the status file" in warnings[0].getMessage() and "6 writes failed" in warnings[1].getMessage()
    assert "written again" in caplog.text and (tmp_path / "status.json").exists()


def test_status_reports_every_cache_and_the_kernel_classes(fake_npu, runtime, tiny_pipe):
    """Every cache (joint freqs, rope's embed memo, masks, 2511 timestep-0 segments, check scratch) is in status."""
    from vllm_omni_ascend_opt.testbed.pipeline import generate

    fake_npu()
    api.select("default,+fused_attention", model=tiny_pipe)
    generate(tiny_pipe, runtime, steps=1, seed=3)
    mem = _report.status_report(tiny_pipe)["memory"]
    assert mem["rope"]["embed_memo_entries"] > 0 and mem["rope"]["embed_memo_bytes"] > 0
    assert mem["rope"]["check_scratch_peak_bytes"] > 0 and mem["qk_norm"]["check_scratch_peak_bytes"] > 0
    assert mem["joint_attention"]["joint_freqs"] > 0 and mem["joint_attention"]["bytes"] > 0
    assert {"masks", "bytes", "check_scratch_peak_bytes"} <= set(mem["fused_attention"])
    assert {"zero_t_segments", "zero_t_bytes"} <= set(mem["shared_modulation"])
    kernels = _report.status_report(tiny_pipe)["kernels"]
    assert kernels["qk_norm"]["kernel"] > 0 and kernels["rope"]["kernel"] > 0
