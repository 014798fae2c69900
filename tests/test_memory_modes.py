"""The plugin in vLLM-Omni's memory and cache modes (VAE slicing and tiling, layerwise and model CPU offload,
cache-dit in a child process, TeaCache, MagCache, LoRA), through its own ``DiffusionModelRunner`` on the CPU runtime."""

from __future__ import annotations

import pytest
import torch

from tests.harness.runner import loaded
from tests.runner_modes import BLOCK_CALLS, MODES, REQUEST, ModeRun, evidence, run_in_children, run_mode
from vllm_omni_ascend_opt import _report, api, registry
from vllm_omni_ascend_opt.testbed.model_runner import RunnerHarness

pytestmark = pytest.mark.slow

ALL_MODES = list(MODES)
CACHES = [m for m in MODES if "cache_backend" in MODES[m].fields]


@pytest.fixture(scope="module")
def runs(runtime, tmp_path_factory):
    """``runs(mode, spec)``: each (mode, selection) run once per module (cache-dit modes in a child process)."""
    done: dict[tuple[str, str], ModeRun] = {}

    def get(mode: str, spec: str) -> ModeRun:
        if (mode, spec) not in done:
            if MODES[mode].own_process:  # every test of such a mode asks for both: their children run together
                specs = sorted({spec, "none", "default"})
                got = run_in_children(mode, specs, tmp_path_factory.mktemp(mode))
                done.update({(mode, s): run for s, run in got.items()})
            else:
                done[(mode, spec)] = run_mode(runtime, mode, spec)
        return done[(mode, spec)]

    return get


@pytest.mark.parametrize("mode", ALL_MODES)
def test_default_equals_none_bitwise_reports_what_ran_and_the_mode_acted(runs, mode):
    """Bitwise ``none`` and repeats; acting == the optimizations that counted their work on the warm request, with
    no fallback (the stock run counts nothing, reports nothing acting); the memo hits warm; the mode itself acted."""
    none, default = runs(mode, "none"), runs(mode, "default")
    for a, b in zip(none.images, default.images, strict=True):
        assert a.abs().sum() > 0
        assert torch.equal(a, b)
    for run in (none, default):
        assert torch.equal(run.images[0], run.images[1])  # a repeated request: the same image
    expected = evidence(mode)
    assert set(default.acting) == set(expected), default.reasons  # the exact CPU stack keeps acting in this mode
    assert {n for n in expected if default.ran(n) > 0} == set(default.acting), default.stats
    assert set(default.stats) <= set(default.acting)  # nothing that reports itself off counted anything
    assert default.fallbacks == {}
    assert all(default.reasons[n] == [] for n in default.acting)
    assert none.acting == [] and none.stats == {} and none.fallbacks == {}
    sm = default.stats["shared_modulation"]
    # layerwise offload included: the memo keys on neither its fresh storage nor its (0,)-shaped placeholders
    assert sm["hits"] > 0 and sm.get("misses", 0) == 0, sm
    joint, vae = default.stats["joint_attention"]["joint_calls"], default.stats["vae_exact"]
    if mode in CACHES:
        assert 0 < joint < BLOCK_CALLS, joint  # the cache backend skipped block forwards on the warm request
        assert default.backends["cache"] is not None
    else:
        assert joint == BLOCK_CALLS
    if mode == "vae_slicing":
        assert default.images[1].shape[0] == 2 and vae["single_frame_decodes"] == 2  # one decode per slice
    elif mode == "vae_tiling":
        assert vae["tiled_decodes"] == 1 and vae["tiles"] == 9 and "single_frame_decodes" not in vae
    else:
        assert vae["single_frame_decodes"] == 1
    offload = {"layerwise_offload": "LayerWiseOffloadBackend", "model_cpu_offload": "ModelLevelOffloadBackend"}
    assert default.backends["offload"] == offload.get(mode)


@pytest.mark.parametrize("backend", list(_report.UPSTREAM_UNSUPPORTED_CACHE_BACKENDS))
def test_cache_backends_listed_as_unsupported_reject_qwen_image(runtime, backend):
    """Every cache backend ``list`` calls unsupported for Qwen-Image upstream really refuses it at load."""
    assert set(_report.UPSTREAM_UNSUPPORTED_CACHE_BACKENDS) == {"sea_cache", "step_cache"}
    api.select("default")
    with pytest.raises(ValueError, match=r"(?i)not support"):
        RunnerHarness.load(runtime, cache_backend=backend, cache_config={})
    assert any(backend in note for note in _report.mode_notes())


def _lora_requests(runtime, tmp_path, spec: str, **fields) -> tuple[list[torch.Tensor], list[dict[str, int]]]:
    """Requests with no adapter, A, B, A, none: the images and shared_modulation's statistics per request."""
    from tests.harness.lora import write_adapter

    sm = registry.get("shared_modulation")
    with loaded(runtime, spec, **fields) as h:
        adapters = {
            name: (name, i + 1, str(write_adapter(tmp_path / name, h.pipeline.transformer, seed=i)), 1.0)
            for i, name in enumerate("AB")
        }
        h.enable_lora()
        images, stats = [], []
        for name in (None, "A", "B", "A", None):
            sm.reset_stats()
            images.append(h.generate(**{**REQUEST, "steps": 2}, lora=adapters.get(name)))
            stats.append(dict(sm.stats))
        return images, stats


@pytest.mark.parametrize("offload", [False, True], ids=["resident", "layerwise_offload"])
def test_lora_switch_is_bitwise_and_misses_the_memo(runtime, tmp_path, offload):
    """Adapters on img_mod / txt_mod: default equals none, the memo misses after every switch, the CFG branch hits."""
    fields = {"enable_layerwise_offload": True} if offload else {}
    ref, _ = _lora_requests(runtime, tmp_path / "none", "none", **fields)
    got, stats = _lora_requests(runtime, tmp_path / "default", "default", **fields)
    for a, b in zip(ref, got, strict=True):
        assert torch.equal(a, b)
    assert not torch.equal(got[0], got[1]) and not torch.equal(got[1], got[2])  # the adapters act
    assert torch.equal(got[1], got[3]) and torch.equal(got[0], got[4])  # switching back: the same images
    for s in stats[1:]:  # every request after a switch: misses (new weights), and hits
        assert s["misses"] >= 2 * 2 and s["hits"] > 0, stats  # 2 steps x 2 blocks at least


@pytest.mark.parametrize("workload", ["tiny-cpu-offload", "tiny-cpu-tiled"])
def test_the_ablation_engine_loads_the_workload_modes_through_vllm_omnis_runner(runtime, tiny_model_dir, workload):
    """The test-bed engine's runner takes the workload's ``od_config`` and ``vae_tiling``; the default stack acts."""
    from vllm_omni_ascend_opt.ablation.engines import TestbedEngine
    from vllm_omni_ascend_opt.ablation.workload import load_workload
    from vllm_omni_ascend_opt.blocks.upstream.layerwise import layerwise_hooks

    wl = load_workload(workload)
    job = {
        "model_path": str(tiny_model_dir),
        "dtype": wl.dtype,
        "height": wl.height,
        "width": wl.width,
        "steps": 2,
        "cfg_scale": 4.0,  # two forwards per step: the second of each step hits the memo on the first request
        "negative_prompt": wl.negative_prompt,
        "image": None,
        "prompts": list(wl.prompts),
        "seeds": [0],
        "max_sequence_length": wl.seq_len(),
        "od_config": dict(wl.od_config),
        "vae_tiling": list(wl.vae_tiling) if wl.vae_tiling else None,
    }
    api.select("default")
    engine = TestbedEngine(job)
    try:
        engine.load()
        assert engine.harness is not None  # through vLLM-Omni's DiffusionModelRunner
        for _ in range(2):  # cold, warm
            for opt in registry.all_optimizations():
                opt.reset_stats()
            gen = engine.generate(wl.prompts[0], 0)
        assert gen.uint8.shape == (wl.height, wl.width, 3)
        acting = engine.active()
        if workload == "tiny-cpu-offload":
            assert layerwise_hooks(engine.pipe.transformer)  # the offloader streams the blocks
            assert "memo_aware_offload" in acting and engine.model_reasons("memo_aware_offload") == []
            assert registry.get("memo_aware_offload").stats["forwards_skipping"] > 0
        else:
            vae = engine.pipe.vae
            assert vae.use_tiling and vae.tile_sample_min_height == wl.vae_tiling[0]
            assert "vae_exact" in acting and registry.get("vae_exact").stats["tiles"] == 9
            assert "memo_aware_offload" not in acting
    finally:
        engine.close()
        api.select("none")
