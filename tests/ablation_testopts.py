"""Two test-only optimizations with known effects for the end-to-end test (``--import tests.ablation_testopts``):
``abl_test_fast`` (exact) removes a 0.4 s sleep from VAE decode; ``abl_test_close`` (close) removes one from prompt
encoding and perturbs the image slightly (within the gates, not pixel-identical). The sleeps are patched in only inside
a worker process with ``ABLATION_TESTOPTS_DELAYS=1`` (the runner imports this module too and stays free of vLLM-Omni).
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

from vllm_omni_ascend_opt.optimization import Optimization
from vllm_omni_ascend_opt.registry import register_optimization

PIPELINE = "vllm_omni.diffusion.models.qwen_image.pipeline_qwen_image"
DELAY_S = 0.4
PERTURBATION = 0.01


class _Marker(Optimization):
    target_modules = (PIPELINE,)
    default_enabled = True

    def _attach(self, model: Any) -> None:
        setattr(model, f"_{self.name}", True)

    def _detach(self, model: Any) -> None:
        model.__dict__.pop(f"_{self.name}", None)


class FastOpt(_Marker):
    name = "abl_test_fast"
    summary = "test only: removes a 0.4 s sleep from VAE decode"
    equivalence = "exact"


class CloseOpt(_Marker):
    name = "abl_test_close"
    summary = "test only: removes a 0.4 s sleep from prompt encoding, perturbs the image slightly"
    equivalence = "close"


FAST = register_optimization(FastOpt())
CLOSE = register_optimization(CloseOpt())


def _in_worker() -> bool:
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    return getattr(spec, "name", None) == "vllm_omni_ascend_opt.ablation.worker"


def _install_delays() -> None:
    import importlib

    import torch

    cls = importlib.import_module(PIPELINE).QwenImagePipeline
    decode, encode = cls._decode_latents, cls.encode_prompt

    def _decode_latents(self, *args: Any, **kwargs: Any) -> Any:
        if not getattr(self, "_abl_test_fast", False):
            time.sleep(DELAY_S)
        out = decode(self, *args, **kwargs)
        if getattr(self, "_abl_test_close", False):
            g = torch.Generator().manual_seed(0)
            noise = torch.randn(out.output.shape, generator=g).to(out.output)
            out.output = (out.output + PERTURBATION * noise).clamp(-1, 1)
        return out

    def encode_prompt(self, *args: Any, **kwargs: Any) -> Any:
        if not getattr(self, "_abl_test_close", False):
            time.sleep(DELAY_S)
        return encode(self, *args, **kwargs)

    cls._decode_latents = _decode_latents
    cls.encode_prompt = encode_prompt


if os.environ.get("ABLATION_TESTOPTS_DELAYS") == "1" and _in_worker():
    _install_delays()
