"""Offline, deterministic builder of a tiny Qwen-Image model directory in diffusers format.

Everything is made from a seed: a tiny Qwen2.5-VL text encoder, a byte-level Qwen2 tokenizer built in memory (no hub),
a tiny ``AutoencoderKLQwenImage``, a tiny ``QwenImageTransformer2DModel`` and a ``FlowMatchEulerDiscreteScheduler``.
The directory is cached on disk (atomic rename, safe for concurrent builders) under
``$VLLM_OMNI_ASCEND_OPT_CACHE`` (default ``~/.cache/vllm-omni-ascend-opt``), keyed on the spec and the seed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

BUILDER_VERSION = 3


@dataclass(frozen=True)
class ModelSpec:
    """Sizes of a test-bed Qwen-Image. Head counts and token counts are chosen divisible by 2 (parallel tests)."""

    name: str
    num_layers: int = 2
    num_attention_heads: int = 4
    attention_head_dim: int = 16
    axes_dims_rope: tuple[int, int, int] = (4, 6, 6)
    joint_attention_dim: int = 32  # = text encoder hidden size
    text_layers: int = 2
    text_heads: int = 2
    vae_base_dim: int = 24
    vae_z_dim: int = 4
    weight_std: float = 0.05  # transformer weights are re-drawn N(0, std) so the tiny net is not near-identity
    vae_latents_mean: tuple[float, ...] = field(default=())
    vae_latents_std: tuple[float, ...] = field(default=())

    @property
    def inner_dim(self) -> int:
        return self.num_attention_heads * self.attention_head_dim

    def transformer_kwargs(self) -> dict:
        return dict(
            patch_size=2,
            in_channels=self.vae_z_dim * 4,
            out_channels=self.vae_z_dim,
            num_layers=self.num_layers,
            attention_head_dim=self.attention_head_dim,
            num_attention_heads=self.num_attention_heads,
            joint_attention_dim=self.joint_attention_dim,
            axes_dims_rope=self.axes_dims_rope,
        )

    def vae_kwargs(self) -> dict:
        z = self.vae_z_dim
        return dict(
            base_dim=self.vae_base_dim,
            z_dim=z,
            dim_mult=[1, 2, 4, 4] if self.vae_base_dim >= 96 else [1, 2, 4],
            num_res_blocks=2 if self.vae_base_dim >= 96 else 1,
            temperal_downsample=[False, True, True] if self.vae_base_dim >= 96 else [False, True],
            latents_mean=list(self.vae_latents_mean or [0.0] * z),
            latents_std=list(self.vae_latents_std or [1.0] * z),
        )

    def key(self, seed: int) -> str:
        blob = json.dumps({"spec": dataclasses.asdict(self), "seed": seed, "v": BUILDER_VERSION}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:12]


#: The default test-bed model: 2 blocks, 4 heads x 16, VAE base 24, 17 MB on disk.
TINY = ModelSpec(name="tiny")
#: Real width (hidden 3072, 24 heads x 128, RoPE axes 16/56/56) at reduced depth, for benchmarks.
REALWIDTH = ModelSpec(
    name="realwidth",
    num_layers=2,
    num_attention_heads=24,
    attention_head_dim=128,
    axes_dims_rope=(16, 56, 56),
    joint_attention_dim=64,
    vae_base_dim=24,
    weight_std=0.02,
)


def cache_root() -> Path:
    return Path(os.environ.get("VLLM_OMNI_ASCEND_OPT_CACHE", Path.home() / ".cache" / "vllm-omni-ascend-opt"))


def build_model_dir(spec: ModelSpec = TINY, seed: int = 0, root: Path | str | None = None) -> Path:
    """Return a diffusers-format Qwen-Image directory for ``spec``; build it once, then reuse the cached copy."""
    root = Path(root) if root is not None else cache_root()
    final = root / f"qwen-image-{spec.name}-{spec.key(seed)}"
    if (final / "model_index.json").is_file():
        return final
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=root))
    try:
        _build(spec, seed, tmp)
        try:
            os.rename(tmp, final)  # atomic; loses the race gracefully if another process finished first
        except OSError:
            if not (final / "model_index.json").is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def _tokenizer():
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import Qwen2Tokenizer

    alphabet = sorted(ByteLevel.alphabet())
    vocab = {"<|endoftext|>": 0, **{c: i + 1 for i, c in enumerate(alphabet)}}
    tok = Qwen2Tokenizer(vocab=vocab, merges=[])
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    return tok


def random_transformer_state_dict(spec: ModelSpec, seed: int = 0) -> dict:
    """A diffusers ``QwenImageTransformer2DModel`` state dict with every tensor drawn N(0, spec.weight_std)."""
    import torch
    from diffusers import QwenImageTransformer2DModel

    torch.manual_seed(seed)
    with torch.device("meta"):
        shapes = QwenImageTransformer2DModel(**spec.transformer_kwargs()).state_dict()
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(v.shape, generator=g) * spec.weight_std for k, v in shapes.items()}


def _build(spec: ModelSpec, seed: int, out: Path) -> None:
    import torch
    from diffusers import (
        AutoencoderKLQwenImage,
        FlowMatchEulerDiscreteScheduler,
        QwenImagePipeline,
        QwenImageTransformer2DModel,
    )
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    torch.manual_seed(seed)
    h = spec.joint_attention_dim
    half = h // spec.text_heads // 2  # mrope sections must sum to half the text head dim
    mrope = [half // 4, half // 4, half - 2 * (half // 4)]
    te_cfg = Qwen2_5_VLConfig(
        text_config=dict(
            hidden_size=h,
            intermediate_size=2 * h,
            num_hidden_layers=spec.text_layers,
            num_attention_heads=spec.text_heads,
            num_key_value_heads=spec.text_heads,
            vocab_size=300,
            bos_token_id=0,
            eos_token_id=0,
            rope_parameters={"rope_type": "default", "mrope_section": mrope, "rope_theta": 1e6},
        ),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=h),
        vocab_size=300,
        bos_token_id=0,
        eos_token_id=0,
        vision_start_token_id=290,
        vision_end_token_id=291,
        vision_token_id=292,
        image_token_id=293,
        video_token_id=294,
    )
    text_encoder = Qwen2_5_VLForConditionalGeneration(te_cfg).eval()
    vae = AutoencoderKLQwenImage(**spec.vae_kwargs())
    transformer = QwenImageTransformer2DModel(**spec.transformer_kwargs())
    transformer.load_state_dict(random_transformer_state_dict(spec, seed))
    pipe = QwenImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=_tokenizer(),
        transformer=transformer,
    )
    pipe.save_pretrained(out)
    (out / "ascend_opt_testbed.json").write_text(
        json.dumps({"spec": dataclasses.asdict(spec), "seed": seed, "builder": BUILDER_VERSION}, indent=1)
    )
