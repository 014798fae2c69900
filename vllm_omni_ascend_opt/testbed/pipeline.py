"""Load a Qwen-Image directory through vLLM-Omni's own loader and run its ``QwenImagePipeline``."""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from vllm_omni_ascend_opt.testbed.runtime import Runtime


@dataclass
class GenerationResult:
    images: torch.Tensor  # [B, 3, H, W] in [-1, 1] (vLLM-Omni's "pt" output), float
    stage_ms: dict[str, float] = field(default_factory=dict)


def load_pipeline(
    rt: Runtime, device: str | torch.device = "cpu", *, dtype: torch.dtype | None = None, **od_overrides: Any
) -> Any:
    """Build and load the pipeline with vLLM-Omni's ``DiffusersPipelineLoader`` (the same call its model runner
    makes). The plugin's loader hook attaches installed optimizations to the result. ``dtype`` and ``od_overrides``
    (``OmniDiffusionConfig`` fields) apply to this pipeline only, on a copy of the runtime's config."""
    from vllm.config.load import LoadConfig
    from vllm_omni.diffusion.model_loader.diffusers_loader import DiffusersPipelineLoader

    od = rt.od_config
    if dtype is not None or od_overrides:
        od = copy.copy(od)
        if dtype is not None:
            od.dtype = dtype
        for k, v in od_overrides.items():
            setattr(od, k, v)
    device = torch.device(device)
    with rt.context():
        loader = DiffusersPipelineLoader(LoadConfig(), od_config=od)
        pipe = loader.load_model(load_device=str(device), device=device)
    pipe.eval()
    _match_text_encoder_dtype(pipe, od.dtype)
    return pipe


def _match_text_encoder_dtype(pipe: Any, dtype: torch.dtype) -> None:
    """vLLM-Omni loads the text encoder in its stored dtype (bf16 in the real checkpoint) and makes the latents in
    that dtype; the test bed stores it in fp32, which breaks a 16-bit run at the transformer's first linear. Cast it
    to the run's 16-bit dtype, as the real checkpoint would be. fp32 runs are unchanged."""
    te = getattr(pipe, "text_encoder", None)
    if te is None or dtype not in (torch.float16, torch.bfloat16):
        return
    if next(te.parameters()).dtype == torch.float32:
        te.to(dtype)


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
) -> Any:
    """A one-request ``DiffusionRequestBatch`` exactly as vLLM-Omni's scheduler hands it to ``forward``."""
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
    )
    p: Any = prompt
    if cfg_scale > 1.0:
        p = {"prompt": prompt, "negative_prompt": negative_prompt if negative_prompt is not None else " "}
    return DiffusionRequestBatch(requests=[OmniDiffusionRequest(prompt=p, sampling_params=sp, request_id=request_id)])


def generate(
    pipe: Any,
    rt: Runtime,
    prompt: str = "a red cat",
    *,
    height: int = 32,
    width: int = 32,
    steps: int = 2,
    seed: int = 42,
    cfg_scale: float = 1.0,
    negative_prompt: str | None = None,
    max_sequence_length: int = 64,
) -> GenerationResult:
    """Run one request through ``QwenImagePipeline.forward`` and return the decoded image tensor."""
    req = make_request(
        prompt,
        height=height,
        width=width,
        steps=steps,
        seed=seed,
        cfg_scale=cfg_scale,
        negative_prompt=negative_prompt,
        max_sequence_length=max_sequence_length,
    )
    t0 = time.perf_counter()
    with rt.context(), torch.no_grad():
        outs = pipe.forward(req)
    total = (time.perf_counter() - t0) * 1e3
    out = outs[0]
    images = out.output
    if images.dim() == 3:
        images = images.unsqueeze(0)
    stages = dict(getattr(out, "stage_durations", None) or {})
    stages["total"] = total
    return GenerationResult(images=images.detach().float().cpu(), stage_ms=stages)
