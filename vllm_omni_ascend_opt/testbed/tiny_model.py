"""Offline, deterministic builder of tiny Qwen-Image model directories in diffusers format, one per pipeline, cached
by spec and seed under ``$VLLM_OMNI_ASCEND_OPT_CACHE`` (default ``~/.cache/vllm-omni-ascend-opt``), renamed atomically.
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

T2I = "QwenImagePipeline"
DMD2 = "QwenImageDMD2Pipeline"
EDIT = "QwenImageEditPipeline"
EDIT_PLUS = "QwenImageEditPlusPipeline"
LAYERED = "QwenImageLayeredPipeline"
#: The vLLM-Omni 0.30 Qwen-Image pipelines the builder can make a directory for.
PIPELINES = (T2I, DMD2, EDIT, EDIT_PLUS, LAYERED)
#: Vision special tokens the image pipelines' vocabulary appends -> the text encoder config field of each one's id.
VISION_TOKENS = {
    "<|vision_start|>": "vision_start_token_id",
    "<|vision_end|>": "vision_end_token_id",
    "<|image_pad|>": "image_token_id",
    "<|video_pad|>": "video_token_id",
}


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
    pipeline: str = T2I  # model_index.json _class_name: which vLLM-Omni pipeline loads this directory
    zero_cond_t: bool = False  # Edit-Plus 2511: condition-image tokens modulated at timestep 0 (modulate_index)

    def __post_init__(self) -> None:
        if self.pipeline not in PIPELINES:
            raise ValueError(f"unknown pipeline {self.pipeline!r}; one of {PIPELINES}")
        if self.zero_cond_t and self.pipeline != EDIT_PLUS:
            raise ValueError("zero_cond_t is an Edit-Plus (Qwen-Image-Edit-2511) transformer setting")

    @property
    def inner_dim(self) -> int:
        return self.num_attention_heads * self.attention_head_dim

    @property
    def layered(self) -> bool:
        """Qwen-Image-Layered: RGBA VAE, 3-D (layer) RoPE and the additional (is-RGB) timestep conditioning."""
        return self.pipeline == LAYERED

    @property
    def image_input(self) -> bool:
        """The prompt encoding runs the text encoder's vision tower on an input image (needs ``processor/``)."""
        return self.pipeline in (EDIT, EDIT_PLUS, LAYERED)

    def transformer_kwargs(self) -> dict:
        kw = dict(
            patch_size=2,
            in_channels=self.vae_z_dim * 4,
            out_channels=self.vae_z_dim,
            num_layers=self.num_layers,
            attention_head_dim=self.attention_head_dim,
            num_attention_heads=self.num_attention_heads,
            joint_attention_dim=self.joint_attention_dim,
            axes_dims_rope=self.axes_dims_rope,
        )
        if self.zero_cond_t:
            kw["zero_cond_t"] = True
        if self.layered:
            kw.update(use_additional_t_cond=True, use_layer3d_rope=True)
        return kw

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
            **({"input_channels": 4} if self.layered else {}),  # Layered decodes RGBA layers
        )

    def key(self, seed: int) -> str:
        spec = dataclasses.asdict(self)
        for name in ("pipeline", "zero_cond_t"):  # added later: defaults keep the text-to-image keys unchanged
            if spec[name] == ModelSpec.__dataclass_fields__[name].default:
                del spec[name]
        blob = json.dumps({"spec": spec, "seed": seed, "v": BUILDER_VERSION}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:12]

    def variant(self, pipeline: str, *, zero_cond_t: bool = False) -> ModelSpec:
        """The same sizes for another pipeline of the family (named ``<name>-<variant>``)."""
        suffix = FAMILY_SUFFIX[(pipeline, zero_cond_t)]
        name = self.name.split("-", 1)[0] + (f"-{suffix}" if suffix else "")
        z = self.vae_z_dim
        if pipeline == LAYERED and z == 4:
            # with z_dim 4, Layered takes the RGBA input as encoded latents (the real model has 16)
            z = 8
        return dataclasses.replace(self, name=name, pipeline=pipeline, zero_cond_t=zero_cond_t, vae_z_dim=z)


FAMILY_SUFFIX = {
    (T2I, False): "",
    (DMD2, False): "dmd2",
    (EDIT, False): "edit",
    (EDIT_PLUS, False): "edit-plus",
    (EDIT_PLUS, True): "edit-2511",
    (LAYERED, False): "layered",
}

#: The default test-bed model: 2 blocks, 4 heads x 16, VAE base 24.
TINY = ModelSpec(name="tiny")
#: The whole family at the test-bed size (text-to-image first), keyed by the variant suffix ("" = text-to-image).
TINY_FAMILY: dict[str, ModelSpec] = {
    suffix or "t2i": TINY.variant(p, zero_cond_t=z) for (p, z), suffix in FAMILY_SUFFIX.items()
}
#: The test-bed width at 12 blocks (the shipped tiny CPU workloads): the plugin's savings stand clear of the noise.
TINY_DEEP = ModelSpec(name="deep", num_layers=12)
TINY_FAMILY["deep"] = TINY_DEEP
TINY_FAMILY["deep-edit-2511"] = TINY_DEEP.variant(EDIT_PLUS, zero_cond_t=True)
#: Real width (hidden 3072, 24 heads x 128, RoPE axes 16/56/56) at reduced depth, for benchmarks.
REALWIDTH = ModelSpec(
    name="realwidth",
    num_attention_heads=24,
    attention_head_dim=128,
    axes_dims_rope=(16, 56, 56),
    joint_attention_dim=64,
    weight_std=0.02,
)


def build_model_dir(spec: ModelSpec = TINY, seed: int = 0, root: Path | str | None = None) -> Path:
    """Return a diffusers-format Qwen-Image directory for ``spec``; build it once, then reuse the cached copy."""
    default = Path.home() / ".cache" / "vllm-omni-ascend-opt"
    root = Path(root if root is not None else os.environ.get("VLLM_OMNI_ASCEND_OPT_CACHE", default))
    final = root / f"qwen-image-{spec.name}-{spec.key(seed)}"  # name carries the variant ("tiny-edit-2511")
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


def _save_processor(tok, out: Path) -> None:
    """``Qwen2VLProcessor`` with the PIL image processor, saved through the image-only subclass (no torchvision)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from vllm_omni_ascend_opt.testbed.pipeline import image_only_processor_class

    # 14-px patches merged 2x2: between 2x2 and 4x4 merged tokens per image
    ip = Qwen2VLImageProcessorPil(min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 16)
    image_only_processor_class()(image_processor=ip, tokenizer=tok).save_pretrained(out)
    cfg_path = out / "processor_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["processor_class"] = "Qwen2VLProcessor"
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True))


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
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2Tokenizer

    torch.manual_seed(seed)
    # byte-level Qwen2 tokenizer: <|endoftext|>, the 256 byte symbols, the chat and (image input) vision tokens
    vocab = {"<|endoftext|>": 0, **{c: i + 1 for i, c in enumerate(sorted(ByteLevel.alphabet()))}}
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=[])
    special = ["<|im_start|>", "<|im_end|>", *(VISION_TOKENS if spec.image_input else ())]
    tokenizer.add_special_tokens({"additional_special_tokens": special})
    # Text-to-image keeps its historical (unused) vision token ids, so its directory stays byte-identical.
    token_ids = (
        {attr: tokenizer.convert_tokens_to_ids(token) for token, attr in VISION_TOKENS.items()}
        if spec.image_input
        else dict(vision_start_token_id=290, vision_end_token_id=291, image_token_id=293, video_token_id=294)
    )
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
        **token_ids,
    )
    text_encoder = Qwen2_5_VLForConditionalGeneration(te_cfg).eval()
    vae = AutoencoderKLQwenImage(**spec.vae_kwargs())
    transformer = QwenImageTransformer2DModel(**spec.transformer_kwargs())
    transformer.load_state_dict(random_transformer_state_dict(spec, seed))
    pipe = QwenImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=transformer,
    )
    pipe.save_pretrained(out)
    if spec.pipeline != T2I:
        index_path = out / "model_index.json"
        index = json.loads(index_path.read_text())
        index["_class_name"] = spec.pipeline
        if spec.image_input:
            _save_processor(tokenizer, out / "processor")
            index["processor"] = ["transformers", "Qwen2VLProcessor"]
        if spec.pipeline == DMD2:
            # FastGen DMD2 contract read by vLLM-Omni's DMD2PipelineMixin (2 steps keeps the test bed quick).
            index["dmd2_config"] = {"num_inference_steps": 2, "solver": "ode", "guidance_scale": 1.0}
        index_path.write_text(json.dumps(index, indent=2, sort_keys=True))
    (out / "ascend_opt_testbed.json").write_text(
        json.dumps({"spec": dataclasses.asdict(spec), "seed": seed, "builder": BUILDER_VERSION}, indent=1)
    )
