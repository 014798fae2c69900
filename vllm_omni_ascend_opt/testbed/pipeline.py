"""Load a Qwen-Image directory through vLLM-Omni's own loader and run its pipeline's ``forward`` (image inputs
pre-processed first, as in ``DiffusionEngine``). Test-bed-only: :func:`tiny_processor_loading` (no torchvision: the
processor without video) and :func:`tiny_image_areas` (the real model's image areas, scaled for the tiny one).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import importlib
import importlib.util
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any
from unittest import mock

import torch

from vllm_omni_ascend_opt.testbed.runtime import Runtime


@dataclass
class GenerationResult:
    images: torch.Tensor  # [B, 3, H, W] in [-1, 1] (vLLM-Omni's "pt" output), float


#: The image pipelines' modules (module-global ``Qwen2VLProcessor`` and ``calculate_dimensions``, patched here).
_IMAGE_MODULES = (
    "vllm_omni.diffusion.models.qwen_image.pipeline_qwen_image_edit",
    "vllm_omni.diffusion.models.qwen_image.pipeline_qwen_image_edit_plus",
    "vllm_omni.diffusion.models.qwen_image.pipeline_qwen_image_layered",
)
#: Test-bed scale of the real models' image areas: 1024^2 -> 64^2 (VAE image), 384^2 -> 32^2 (condition image).
AREA_SCALE = (64 / 1024) ** 2


@functools.cache
def image_only_processor_class() -> type:
    """``Qwen2VLProcessor`` without its video processor (see module doc); a real subclass, same ``__call__``."""
    from transformers import Qwen2VLProcessor
    from transformers.processing_utils import ProcessorMixin

    class ImageOnlyQwen2VLProcessor(Qwen2VLProcessor):
        """Qwen2VLProcessor(image_processor, tokenizer): images and text only (no torchvision needed)."""

        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs: Any) -> None:
            # Qwen2VLProcessor.__init__'s token bookkeeping, then ProcessorMixin without the video processor.
            self.image_token = getattr(tokenizer, "image_token", None) or "<|image_pad|>"
            self.video_token = getattr(tokenizer, "video_token", None) or "<|video_pad|>"
            self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
            self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
            ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)

    return ImageOnlyQwen2VLProcessor


@contextlib.contextmanager
def _patched_globals(modules: tuple[str, ...], name: str, make: Any) -> Iterator[None]:
    """Set ``module.<name> = make(old)`` in each module for the duration; restored by identity afterwards."""
    with contextlib.ExitStack() as patches:
        for mod_name in modules:
            mod = importlib.import_module(mod_name)
            patches.enter_context(mock.patch.object(mod, name, make(getattr(mod, name))))
        yield


@contextlib.contextmanager
def tiny_processor_loading() -> Iterator[None]:
    """While loading an image pipeline without torchvision: serve ``Qwen2VLProcessor`` as the image-only class."""
    if importlib.util.find_spec("torchvision") is not None:
        yield
        return
    with _patched_globals(_IMAGE_MODULES, "Qwen2VLProcessor", lambda _old: image_only_processor_class()):
        yield


@contextlib.contextmanager
def tiny_image_areas(scale: float = AREA_SCALE) -> Iterator[None]:
    """While pre-processing: the pipelines' ``calculate_dimensions(target_area, ratio)`` sees ``target_area * scale``."""
    with _patched_globals(_IMAGE_MODULES, "calculate_dimensions", lambda old: lambda area, r: old(area * scale, r)):
        yield


def load_pipeline(
    rt: Runtime,
    device: str | torch.device = "cpu",
    *,
    dtype: torch.dtype | None = None,
    model: str | None = None,
    **od_overrides: Any,
) -> Any:
    """The pipeline as vLLM-Omni's model runner loads it (the plugin attaches there). ``dtype``, ``model`` (another
    model directory) and ``od_overrides`` (``OmniDiffusionConfig`` fields) apply to a copy of the runtime's config."""
    from vllm.config.load import LoadConfig
    from vllm_omni.diffusion.model_loader.diffusers_loader import DiffusersPipelineLoader

    od = rt.od_config
    if dtype is not None or od_overrides or (model is not None and str(model) != od.model):
        od = copy.copy(od)
        if dtype is not None:
            od.dtype = dtype
        if model is not None and str(model) != od.model:
            od.model = str(model)
            od.model_class_name = None
            od.enrich_config()  # class name and transformer config (zero_cond_t, layer-3D RoPE) of that directory
        for k, v in od_overrides.items():
            setattr(od, k, v)
    device = torch.device(device)
    with rt.context(), tiny_processor_loading():
        loader = DiffusersPipelineLoader(LoadConfig(), od_config=od)
        pipe = loader.load_model(load_device=str(device), device=device)
    pipe.eval()
    # the text encoder loads in its stored dtype (here fp32): cast it to a 16-bit run's dtype
    te = getattr(pipe, "text_encoder", None)
    if te is not None and od.dtype in (torch.float16, torch.bfloat16) and next(te.parameters()).dtype == torch.float32:
        te.to(od.dtype)
    return pipe


def make_request(
    prompt: str,
    *,
    height: int,
    width: int,
    steps: int,
    seed: int,
    cfg_scale: float = 1.0,
    negative_prompt: str | None = None,
    max_sequence_length: int = 64,
    request_id: str = "ascend-opt",
    image: Any = None,
    pre_process: Any = None,
    **sampling: Any,
) -> Any:
    """A one-request ``DiffusionRequestBatch`` as the scheduler hands it to ``forward``; ``image`` goes into
    ``multi_modal_data``, then ``pre_process`` runs under :func:`tiny_image_areas`; ``sampling``: more fields."""
    from vllm_omni.diffusion.request import OmniDiffusionRequest
    from vllm_omni.diffusion.worker.request_batch import DiffusionRequestBatch
    from vllm_omni.inputs.data import OmniDiffusionSamplingParams

    sp = OmniDiffusionSamplingParams(
        height=height,
        width=width,
        num_inference_steps=steps,
        seed=seed,
        generator=torch.Generator("cpu").manual_seed(seed),
        true_cfg_scale=cfg_scale,
        output_type="pt",
        max_sequence_length=max_sequence_length,
        **sampling,
    )
    p: Any = prompt
    if cfg_scale > 1.0:
        p = {"prompt": prompt, "negative_prompt": negative_prompt if negative_prompt is not None else " "}
    if image is not None:
        p = {"prompt": prompt} if isinstance(p, str) else dict(p)
        p["multi_modal_data"] = {"image": image}
    req = OmniDiffusionRequest(prompt=p, sampling_params=sp, request_id=request_id)
    if pre_process is not None:
        with tiny_image_areas():
            req = pre_process(req)
    return DiffusionRequestBatch(requests=[req])


def run_forward(pipe: Any, req: Any) -> Any:
    """``pipe.forward(req)``; DMD2 sanitizes then runs the base forward (its own passes rejected keywords)."""
    from vllm_omni.diffusion.models.qwen_image.pipeline_qwen_image import QwenImageDMD2Pipeline, QwenImagePipeline

    if isinstance(pipe, QwenImageDMD2Pipeline):
        pipe._sanitize_dmd2_request(req)
        return QwenImagePipeline.forward(pipe, req)
    return pipe.forward(req)


def pre_process_func(pipe: Any) -> Any:
    """The pre-process function vLLM-Omni's registry has for ``pipe``'s class (None for text-to-image)."""
    from vllm_omni.diffusion.registry import get_diffusion_pre_process_func

    fn = pipe.__dict__.get("_ascend_opt_pre_process")
    if fn is None:
        fn = get_diffusion_pre_process_func(pipe.od_config) or False
        pipe.__dict__["_ascend_opt_pre_process"] = fn
    return fn or None


def sample_image(seed: int, width: int = 48, height: int = 32, mode: str = "RGB") -> Any:
    """A deterministic PIL input image (smooth gradients plus seeded noise) for the edit / layered pipelines."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    channels = len(mode)
    yy, xx = np.mgrid[0:height, 0:width]
    base = np.stack([(xx * (c + 1) * 7 + yy * (3 - c) * 5) % 256 for c in range(channels)], axis=-1)
    noise = rng.integers(0, 64, size=(height, width, channels))
    return Image.fromarray(((base + noise) % 256).astype(np.uint8), mode=mode)


def generate(
    pipe: Any,
    rt: Runtime,
    prompt: str = "a red cat",
    *,
    height: int = 32,
    width: int = 32,
    steps: int = 2,
    seed: int = 42,
    image: Any = None,
    **request: Any,
) -> GenerationResult:
    """One request (:func:`make_request` keywords; ``image`` for image pipelines) through ``forward``: its images."""
    pre_process = pre_process_func(pipe) if image is not None else None
    req = make_request(
        prompt, height=height, width=width, steps=steps, seed=seed, image=image, pre_process=pre_process, **request
    )
    with rt.context(), torch.no_grad():
        outs = run_forward(pipe, req)
    out = outs[0] if isinstance(outs, list) else outs  # DMD2 / text-to-image: list; edit / layered: one output
    return GenerationResult(images=decoded_images(out))


def decoded_images(out: Any) -> torch.Tensor:
    """A ``DiffusionOutput``'s images as ``[B, C, H, W]`` float on the CPU (Layered: its layers stacked)."""
    images = out.output
    if isinstance(images, list):  # Layered: one [layers, C, H, W] tensor per batch item
        images = torch.cat(list(images), dim=0)
    if images.dim() == 3:
        images = images.unsqueeze(0)
    return images.detach().float().cpu()
