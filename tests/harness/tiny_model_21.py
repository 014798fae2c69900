"""Tiny, seeded Qwen-Image-2.1 pieces (vLLM-Omni 0.32.0rc1+, ``models/qwen_image_21``): a different model whose NPU
work upstream already does, which the plugin must recognise and leave alone; :func:`available` says whether this
vLLM-Omni has it.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

import torch
import torch.nn as nn

PACKAGE = "vllm_omni.diffusion.models.qwen_image_21"
TRANSFORMER = f"{PACKAGE}.qwen_image_21_transformer"
PIPELINE = f"{PACKAGE}.pipeline_qwen_image_21"
DIST_VAE = "vllm_omni.diffusion.distributed.autoencoders.autoencoder_kl_qwenimage21"


Z = 4  # latent channels
#: The tiny ``QwenImage21Transformer2DModel``.
TRANSFORMER_KWARGS: dict[str, Any] = dict(
    patch_size=1,
    in_channels=Z,
    out_channels=Z,
    num_layers=2,
    attention_head_dim=16,
    num_attention_heads=2,
    context_in_dim=32,
    axes_dims_rope=(4, 6, 6),
)
#: The tiny ``DistributedAutoencoderKLQwenImage21``.
VAE_KWARGS: dict[str, Any] = dict(
    base_dim=16,
    decoder_base_dim=16,
    z_dim=Z,
    dim_mult=[1, 2, 2],  # the last two equal, as upstream's [1, 2, 4, 8, 8] (AvgDown3D shortcut)
    num_res_blocks=1,
    temperal_downsample=[False, True],
    latents_mean=[0.25 * (i - Z / 2) for i in range(Z)],
    latents_std=[1.0 + 0.5 * i for i in range(Z)],
    scale_factor_spatial=None,
)
WEIGHT_STD = 0.05


def available() -> bool:
    """The installed vLLM-Omni ships Qwen-Image-2.1 (0.32.0rc1+)."""
    try:
        return importlib.util.find_spec(PACKAGE) is not None
    except ModuleNotFoundError:
        return False


def build_transformer(runtime: Any, seed: int = 0) -> nn.Module:
    """A tiny ``QwenImage21Transformer2DModel`` with N(0, std) weights loaded through its own ``load_weights``."""
    mod = importlib.import_module(TRANSFORMER)
    with runtime.context():
        tr = mod.QwenImage21Transformer2DModel(od_config=runtime.od_config, **TRANSFORMER_KWARGS)
    g = torch.Generator().manual_seed(seed)
    weights = {n: torch.randn(p.shape, generator=g) * WEIGHT_STD for n, p in tr.named_parameters()}
    tr.load_weights(weights.items())
    return tr.eval()


def build_vae(seed: int = 1) -> nn.Module:
    """vLLM-Omni's ``DistributedAutoencoderKLQwenImage21`` at a tiny width, N(0, 0.05) weights."""
    cls = importlib.import_module(DIST_VAE).DistributedAutoencoderKLQwenImage21
    vae = cls(**VAE_KWARGS)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in vae.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * WEIGHT_STD)
    vae.init_distributed()
    return vae.eval()


def build_pipeline(runtime: Any, seed: int = 0) -> nn.Module:
    """A ``QwenImage21Pipeline`` with the tiny transformer and VAE, assembled without ``__init__`` (no Qwen3-VL text
    encoder): enough to attach optimizations to and to decode latents with its own ``_decode_latents``."""
    cls = importlib.import_module(PIPELINE).QwenImage21Pipeline
    pipe = cls.__new__(cls)
    nn.Module.__init__(pipe)
    pipe.od_config = runtime.od_config
    pipe.parallel_config = runtime.od_config.parallel_config
    pipe.transformer = build_transformer(runtime, seed)
    pipe.vae = build_vae(seed + 1)
    pipe.vae_scale_factor = pipe.vae.spatial_compression_ratio
    return pipe


def latents(pipe: nn.Module, height: int = 32, width: int = 32, seed: int = 0, dtype: torch.dtype = torch.float32):
    """Packed latents ``[B, h * w, C]`` for an image of ``height`` x ``width``, as the denoise loop leaves them."""
    f = pipe.vae_scale_factor
    h, w = 2 * (height // (f * 2)), 2 * (width // (f * 2))
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, h * w, pipe.vae.config.z_dim, generator=g).to(dtype)
