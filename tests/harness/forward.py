"""The tiny test-bed transformer built directly (seeded random weights), its inputs and one forward."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch

from tests.harness.stock import stock_then
from vllm_omni_ascend_opt.testbed import TINY
from vllm_omni_ascend_opt.testbed.tiny_model import random_transformer_state_dict


def build(runtime: Any, dtype: torch.dtype = torch.float32, seed: int = 0, **kwargs: Any) -> torch.nn.Module:
    """vLLM-Omni's transformer at the tiny spec (``kwargs`` override it), weights loaded through ``load_weights``."""
    from vllm_omni.diffusion.models.qwen_image.qwen_image_transformer import QwenImageTransformer2DModel

    with runtime.context():
        tr = QwenImageTransformer2DModel(od_config=runtime.od_config, **{**TINY.transformer_kwargs(), **kwargs})
    tr.load_weights(random_transformer_state_dict(TINY, seed).items())
    return tr.to(dtype).eval()


def inputs(
    dtype: torch.dtype,
    batch: int = 1,
    hw: tuple[int, int] = (2, 2),
    txt: int = 7,
    pad: int = 0,
    t: tuple[float, ...] = (0.5,),
    seed: int = 0,
    images: int = 1,
) -> dict[str, Any]:
    """One transformer call's kwargs: last row's final ``pad`` text tokens masked, row i at ``t[i % len(t)]``."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(batch, txt, dtype=torch.bool)
    if pad:
        mask[-1, txt - pad :] = False
    return dict(
        hidden_states=torch.randn(batch, hw[0] * hw[1] * images, TINY.vae_z_dim * 4, generator=g).to(dtype),
        encoder_hidden_states=torch.randn(batch, txt, TINY.joint_attention_dim, generator=g).to(dtype),
        encoder_hidden_states_mask=mask,
        timestep=torch.tensor([t[i % len(t)] for i in range(batch)]).to(dtype),
        img_shapes=[[(1, *hw)] * images] * batch,
        txt_seq_lens=[txt] * batch,
        return_dict=False,
    )


def fwd(tr: Any, runtime: Any, kw: dict[str, Any], grad: bool = False) -> torch.Tensor:
    with runtime.context(), torch.set_grad_enabled(grad):
        return tr(**kw)[0].detach()


def tiny_forward(
    rt: Any,
    tr: Any,
    *,
    batch: int = 1,
    hw: tuple[int, int] = (4, 4),
    txt: int = 7,
    pad: bool = False,
    seed: int = 1,
    mode: Callable[[], AbstractContextManager[Any]] = torch.no_grad,
) -> torch.Tensor:
    """``batch`` rows at timesteps 0.5 .. 0.8, ``pad``: last row's final 3 text tokens masked, under grad ``mode``."""
    kw = inputs(tr.proj_out.weight.dtype, batch, hw, txt, pad=3 if pad else 0, seed=seed)
    kw.update(
        encoder_hidden_states_mask=kw["encoder_hidden_states_mask"].long(), timestep=torch.linspace(0.5, 0.8, batch)
    )
    with rt.context(), mode():
        return tr(**kw)[0]


def stock_outputs(tr: Any, runtime: Any, kws: list[dict[str, Any]], spec: str) -> list[torch.Tensor]:
    """Stock's outputs of ``tr`` as it is now, one per input of ``kws``; then ``spec`` is selected on it."""
    return stock_then(spec, tr, lambda: [fwd(tr, runtime, kw) for kw in kws])
