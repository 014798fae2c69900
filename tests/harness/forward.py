"""One warm-able forward of the tiny test-bed transformer on random inputs (fixed seed), in its weights' dtype."""

from __future__ import annotations

from typing import Any

import torch

from vllm_omni_ascend_opt.testbed import TINY


def tiny_forward(rt: Any, tr: Any, *, txt: int = 7, hw: tuple[int, int] = (4, 4), seed: int = 1) -> torch.Tensor:
    dtype = tr.proj_out.weight.dtype
    g = torch.Generator().manual_seed(seed)
    hs = torch.randn(1, hw[0] * hw[1], TINY.vae_z_dim * 4, generator=g).to(dtype)
    ehs = torch.randn(1, txt, TINY.joint_attention_dim, generator=g).to(dtype)
    with rt.context(), torch.no_grad():
        return tr(
            hidden_states=hs,
            encoder_hidden_states=ehs,
            encoder_hidden_states_mask=torch.ones(1, txt, dtype=torch.long),
            timestep=torch.tensor([0.5]),
            img_shapes=[[(1, *hw)]],
            txt_seq_lens=[txt],
        ).sample
