"""Qwen-Image-2.1: upstream already does what the optimizations do, so each stays off with its reason and attaches
nothing: on a stand-in class (every version) and the real tiny 2.1 pipeline (marker ``versions``)."""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn as nn

from tests.fake_torch_npu import formats
from tests.harness import tiny_model_21 as t21
from vllm_omni_ascend_opt import _report, api, registry
from vllm_omni_ascend_opt.blocks.upstream import fingerprints, targets
from vllm_omni_ascend_opt.opts import nz_weights

PREFIX = "Qwen-Image-2.1 ("


def _stand_in(cls_name: str, module: str) -> nn.Module:
    """A pipeline-like module of class ``cls_name`` in ``module`` holding a bf16 linear stack as ``transformer``."""
    cls = type(cls_name, (nn.Module,), {"__module__": module})
    pipe = cls()
    torch.manual_seed(0)
    pipe.transformer = nn.Sequential(nn.Linear(32, 64), nn.Linear(64, 32)).to(torch.bfloat16)
    return pipe


def test_nz_weights_never_casts_and_every_optimization_names_qwen_image_21_first(fake_npu):
    importlib.import_module(targets.TRANSFORMER)  # nz_weights installs once its target module is imported
    fake = fake_npu()
    control = _stand_in("SomePipeline", "somewhere.else")
    api.select("none,+nz_weights", model=control)
    assert len(nz_weights.OPT.report(control)["cast"]) == 2  # the same stack is cast under another class
    q21 = _stand_in("QwenImage21Pipeline", f"{fingerprints.QWEN_IMAGE_21_PACKAGE}.pipeline_qwen_image_21")
    calls = fake.calls["npu_format_cast"]
    api.select("none,+nz_weights", model=q21)
    assert not nz_weights.OPT.is_attached(q21) and nz_weights.OPT.report(q21)["cast"] == []
    assert fake.calls["npu_format_cast"] == calls
    assert all(fake.get_npu_format(p) == formats.ND for p in q21.transformer.parameters())
    (why, *_) = nz_weights.OPT.reasons_inactive(q21)
    assert why.startswith(f"{PREFIX}QwenImage21Pipeline): upstream casts its bf16 linear weights to FRACTAL_NZ")
    assert "never casts there" in why
    importlib.import_module(targets.DIST_VAE)
    api.select("all", model=q21)
    for opt in registry.all_optimizations():
        assert opt.on_qwen_image_21, opt.name  # each says why, in its own words
        assert _report.explain(opt, q21)[0] == f"{PREFIX}QwenImage21Pipeline): {opt.on_qwen_image_21}", opt.name
        assert not opt.is_attached(q21)
    assert _report.acting(q21) == []


needs_21 = pytest.mark.skipif(not t21.available(), reason="this vLLM-Omni has no Qwen-Image-2.1 (0.32.0rc1+)")


@pytest.fixture(scope="module")
def pipe21(runtime):
    return t21.build_pipeline(runtime)


def _snapshot(model: nn.Module) -> dict:
    return {
        "classes": {n: type(m) for n, m in model.named_modules()},
        "forwards": {n: m.__dict__.get("forward") for n, m in model.named_modules()},
        "params": {n: (p.data_ptr(), p._version, p.dtype) for n, p in model.named_parameters()},
        "attrs": {n: m.__dict__.get("_decode_latents") for n, m in model.named_modules()},
    }


@pytest.mark.versions
@needs_21
def test_real_qwen_image_21_is_recognised_and_left_alone(pipe21, runtime, fake_npu):
    assert fingerprints.qwen_image_21(pipe21) == "QwenImage21Pipeline"
    assert fingerprints.qwen_image_21(pipe21.transformer) == "QwenImage21Transformer2DModel"
    lat = t21.latents(pipe21)

    def decode() -> torch.Tensor:
        with runtime.context(), torch.no_grad():
            return pipe21._decode_latents(lat, 32, 32, "pil").output

    api.select("none", model=pipe21)
    before = _snapshot(pipe21)
    want = decode()
    api.select("all", model=pipe21)
    assert _snapshot(pipe21) == before  # no class, forward, weight or method of it changed
    assert torch.equal(decode(), want)
    for opt in registry.all_optimizations():
        assert _report.explain(opt, pipe21)[0].startswith(f"{PREFIX}QwenImage21Pipeline)"), opt.name
    assert _report.acting(pipe21) == [] and _report.acting(pipe21.transformer) == []
    api.select("none", model=pipe21)
    fake = fake_npu()  # its weights are never cast
    tr = pipe21.transformer.to(torch.bfloat16)
    try:
        api.select("none,+nz_weights", model=pipe21)
        api.select("none,+nz_weights", model=tr)  # attached to the transformer itself: recognised too
        assert fake.calls["npu_format_cast"] == 0
        assert all(fake.get_npu_format(p) == formats.ND for p in tr.parameters())
        assert nz_weights.OPT.reasons_inactive(tr)[0].startswith(f"{PREFIX}QwenImage21Transformer2DModel")
    finally:
        api.select("none", model=pipe21)
        tr.to(torch.float32)
