"""The CPU test bed itself: the tiny model builds offline, loads through vLLM-Omni and matches diffusers."""

from __future__ import annotations

import json

import pytest
import torch

from vllm_omni_ascend_opt.testbed import TINY, build_model_dir
from vllm_omni_ascend_opt.testbed.pipeline import generate


def test_builder_is_cached_and_deterministic(tiny_model_dir, tmp_path):
    assert build_model_dir() == tiny_model_dir  # cached: same path, no rebuild
    meta = json.loads((tiny_model_dir / "ascend_opt_testbed.json").read_text())
    assert meta["spec"]["name"] == "tiny" and meta["seed"] == 0
    other = build_model_dir(TINY, seed=0, root=tmp_path)
    a = (tiny_model_dir / "transformer" / "diffusion_pytorch_model.safetensors").read_bytes()
    b = (other / "transformer" / "diffusion_pytorch_model.safetensors").read_bytes()
    assert a == b


def test_pipeline_is_vllm_omnis_own(tiny_pipe):
    from vllm_omni.diffusion.distributed.autoencoders.autoencoder_kl_qwenimage import (
        DistributedAutoencoderKLQwenImage,
    )
    from vllm_omni.diffusion.models.qwen_image.pipeline_qwen_image import QwenImagePipeline
    from vllm_omni.diffusion.models.qwen_image.qwen_image_transformer import QwenImageTransformer2DModel

    assert type(tiny_pipe) is QwenImagePipeline
    assert type(tiny_pipe.transformer) is QwenImageTransformer2DModel
    assert type(tiny_pipe.vae) is DistributedAutoencoderKLQwenImage


def test_generation_is_deterministic(tiny_pipe, runtime):
    a = generate(tiny_pipe, runtime, steps=2, seed=7, cfg_scale=2.0)
    b = generate(tiny_pipe, runtime, steps=2, seed=7, cfg_scale=2.0)
    c = generate(tiny_pipe, runtime, steps=2, seed=8, cfg_scale=2.0)
    assert a.images.shape == (1, 3, 32, 32)
    assert torch.equal(a.images, b.images)
    assert not torch.equal(a.images, c.images)
    assert a.images.abs().max() <= 1.0


@pytest.mark.parametrize("cfg", [1.0, 3.0])
def test_matches_diffusers_pipeline(tiny_pipe, runtime, tiny_model_dir, cfg):
    """vLLM-Omni's pipeline equals diffusers' on the same directory (its images in [-1, 1], diffusers' in [0, 1])."""
    from diffusers import QwenImagePipeline

    ref = QwenImagePipeline.from_pretrained(str(tiny_model_dir), torch_dtype=torch.float32)
    ref.set_progress_bar_config(disable=True)
    kw = dict(height=32, width=48, num_inference_steps=3)
    with torch.no_grad():
        want = ref(
            prompt="a red cat",
            negative_prompt=" " if cfg > 1 else None,
            true_cfg_scale=cfg,
            generator=torch.Generator().manual_seed(5),
            output_type="pt",
            max_sequence_length=64,
            **kw,
        ).images
    got = generate(tiny_pipe, runtime, "a red cat", height=32, width=48, steps=3, seed=5, cfg_scale=cfg)
    assert got.images.shape == want.shape
    torch.testing.assert_close((got.images / 2 + 0.5).clamp(0, 1), want, atol=1e-5, rtol=0)
