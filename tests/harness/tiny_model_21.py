"""Tiny, seeded Qwen-Image-2.1 pieces (vLLM-Omni 0.32.0rc1+, ``models/qwen_image_21``) for the tests.

Qwen-Image-2.1 is a different model (single-stream DiT, its own VAE, a Qwen3-VL encoder) whose NPU work upstream
already does; the plugin must recognise it and leave it alone. The tests need the real classes at a tiny size:
:func:`build_transformer`, :func:`build_vae`, :func:`build_pipeline` (assembled without ``__init__``: enough for
attach / detach and ``_decode_latents``) and :func:`latents`; :func:`available` says whether vLLM-Omni has 2.1.
"""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

PACKAGE = "vllm_omni.diffusion.models.qwen_image_21"
TRANSFORMER = f"{PACKAGE}.qwen_image_21_transformer"
PIPELINE = f"{PACKAGE}.pipeline_qwen_image_21"
DIST_VAE = "vllm_omni.diffusion.distributed.autoencoders.autoencoder_kl_qwenimage21"


@dataclass(frozen=True)
class Spec21:
    """Sizes of the tiny Qwen-Image-2.1 pieces."""

    num_layers: int = 2
    num_attention_heads: int = 2
    attention_head_dim: int = 16
    context_in_dim: int = 32
    axes_dims_rope: tuple[int, int, int] = (4, 6, 6)
    vae_base_dim: int = 16
    vae_z_dim: int = 4
    weight_std: float = 0.05

    def transformer_kwargs(self) -> dict[str, Any]:
        return dict(
            patch_size=1,
            in_channels=self.vae_z_dim,
            out_channels=self.vae_z_dim,
            num_layers=self.num_layers,
            attention_head_dim=self.attention_head_dim,
            num_attention_heads=self.num_attention_heads,
            context_in_dim=self.context_in_dim,
            axes_dims_rope=self.axes_dims_rope,
        )

    def vae_kwargs(self) -> dict[str, Any]:
        z = self.vae_z_dim
        return dict(
            base_dim=self.vae_base_dim,
            decoder_base_dim=self.vae_base_dim,
            z_dim=z,
            dim_mult=[1, 2, 2],  # the last two equal, as upstream's [1, 2, 4, 8, 8] (AvgDown3D shortcut)
            num_res_blocks=1,
            temperal_downsample=[False, True],
            latents_mean=[0.25 * (i - z / 2) for i in range(z)],
            latents_std=[1.0 + 0.5 * i for i in range(z)],
            scale_factor_spatial=None,
        )


SPEC21 = Spec21()


def available() -> bool:
    """The installed vLLM-Omni ships Qwen-Image-2.1 (0.32.0rc1+)."""
    try:
        return importlib.util.find_spec(PACKAGE) is not None
    except ModuleNotFoundError:
        return False


def build_transformer(runtime: Any, spec: Spec21 = SPEC21, seed: int = 0) -> nn.Module:
    """A tiny ``QwenImage21Transformer2DModel`` with N(0, std) weights loaded through its own ``load_weights``."""
    mod = importlib.import_module(TRANSFORMER)
    with runtime.context():
        tr = mod.QwenImage21Transformer2DModel(od_config=runtime.od_config, **spec.transformer_kwargs())
    g = torch.Generator().manual_seed(seed)
    weights = {n: torch.randn(p.shape, generator=g) * spec.weight_std for n, p in tr.named_parameters()}
    tr.load_weights(weights.items())
    return tr.eval()


def build_vae(spec: Spec21 = SPEC21, seed: int = 1) -> nn.Module:
    """vLLM-Omni's ``DistributedAutoencoderKLQwenImage21`` at a tiny width, N(0, 0.05) weights."""
    cls = importlib.import_module(DIST_VAE).DistributedAutoencoderKLQwenImage21
    vae = cls(**spec.vae_kwargs())
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in vae.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    vae.init_distributed()
    return vae.eval()


def build_pipeline(runtime: Any, spec: Spec21 = SPEC21, seed: int = 0) -> nn.Module:
    """A ``QwenImage21Pipeline`` with the tiny transformer and VAE, assembled without ``__init__`` (which would load
    a Qwen3-VL text encoder and processor from a model directory): enough to attach optimizations to and to decode
    latents with its own ``_decode_latents``."""
    cls = importlib.import_module(PIPELINE).QwenImage21Pipeline
    pipe = cls.__new__(cls)
    nn.Module.__init__(pipe)
    pipe.od_config = runtime.od_config
    pipe.parallel_config = runtime.od_config.parallel_config
    pipe.transformer = build_transformer(runtime, spec, seed)
    pipe.vae = build_vae(spec, seed + 1)
    pipe.vae_scale_factor = pipe.vae.spatial_compression_ratio
    return pipe


def latents(pipe: nn.Module, height: int = 32, width: int = 32, seed: int = 0, dtype: torch.dtype = torch.float32):
    """Packed latents ``[B, h * w, C]`` for an image of ``height`` x ``width``, as the denoise loop leaves them."""
    f = pipe.vae_scale_factor
    h, w = 2 * (height // (f * 2)), 2 * (width // (f * 2))
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, h * w, pipe.vae.config.z_dim, generator=g).to(dtype)
