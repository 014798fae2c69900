"""One forward of a tiny test-bed transformer on pipeline-shaped random inputs (fixed seed), in its weights' dtype."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch

from vllm_omni_ascend_opt.testbed import TINY


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
    """``batch`` rows at different timesteps; ``pad`` masks the last row's final 3 text tokens; run under ``mode``
    (a grad mode: ``torch.no_grad``, ``torch.inference_mode``, ``torch.enable_grad``)."""
    dtype = tr.proj_out.weight.dtype
    g = torch.Generator().manual_seed(seed)
    hs = torch.randn(batch, hw[0] * hw[1], TINY.vae_z_dim * 4, generator=g).to(dtype)
    ehs = torch.randn(batch, txt, TINY.joint_attention_dim, generator=g).to(dtype)
    mask = torch.ones(batch, txt, dtype=torch.long)
    if pad:
        mask[-1, txt - 3 :] = 0
    with rt.context(), mode():
        return tr(
            hidden_states=hs,
            encoder_hidden_states=ehs,
            encoder_hidden_states_mask=mask,
            timestep=torch.linspace(0.5, 0.8, batch),
            img_shapes=[[(1, *hw)]] * batch,
            txt_seq_lens=[txt] * batch,
        ).sample
