"""Kernel launches per block of vLLM-Omni's real transformer on a warm forward, for a flag selection, dtype and width
(:class:`~.opcount.OpCounter`, or with the caller's torch_npu fake :class:`~.npu_ops.NpuOpCounter`)."""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any
from unittest import mock

import torch

from vllm_omni_ascend_opt.testbed.tiny_model import TINY, ModelSpec, random_transformer_state_dict

TEXT_TOKENS = 32
TIMESTEP = 0.7


@dataclass
class BlockCount:
    """Launches of one block on a warm forward: ``total``, by op name, and what the NPU counter could not place."""

    total: int
    counts: Counter[str] = field(default_factory=Counter)
    unresolved: Counter[str] = field(default_factory=Counter)
    #: launches of the whole warm transformer call, and its number of blocks (every block launches ``total``)
    call_total: int = 0
    blocks: int = 0

    @property
    def outside(self) -> int:
        """Launches of one transformer call outside its blocks (RoPE tables, timestep embedding, norm_out ...)."""
        return self.call_total - self.blocks * self.total


def new_transformer(rt: Any, spec: ModelSpec, dtype: torch.dtype, mode: Any = None) -> Any:
    """vLLM-Omni's transformer for ``spec``, allocated in ``dtype`` (under the dispatch mode ``mode``, if any)."""
    from vllm_omni.diffusion.models.qwen_image.qwen_image_transformer import QwenImageTransformer2DModel

    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # vLLM's linears allocate in the default dtype: no fp32 copy of the model
    try:
        with mode or contextlib.nullcontext(), rt.context():
            return QwenImageTransformer2DModel(od_config=rt.od_config, **spec.transformer_kwargs())
    finally:
        torch.set_default_dtype(default)


def build_transformer(rt: Any, spec: ModelSpec, dtype: torch.dtype) -> Any:
    """vLLM-Omni's transformer for ``spec`` with the test bed's seeded random weights, in ``dtype``."""
    tr = new_transformer(rt, spec, dtype)
    tr.load_weights(random_transformer_state_dict(spec, seed=0).items())
    return tr.to(dtype).eval()


def t2i_inputs(
    tr: Any, dtype: torch.dtype, height: int = 128, width: int = 128, batch: int = 1, text_tokens: int = TEXT_TOKENS
) -> dict[str, Any]:
    """One text-to-image denoise step's transformer inputs (CFG off)."""
    g = torch.Generator().manual_seed(0)
    h, w = height // 16, width // 16  # VAE /8, then 2x2 packing
    return dict(
        hidden_states=torch.randn(batch, h * w, tr.in_channels, generator=g).to(dtype),
        encoder_hidden_states=torch.randn(batch, text_tokens, tr.txt_norm.normalized_shape[0], generator=g).to(dtype),
        encoder_hidden_states_mask=torch.ones(batch, text_tokens, dtype=torch.bool),
        timestep=torch.full((batch,), TIMESTEP, dtype=dtype),
        img_shapes=[[(1, h, w)]] * batch,
        txt_seq_lens=[text_tokens] * batch,
        return_dict=False,
    )


@contextlib.contextmanager
def npu_dispatch(tr: Any) -> Iterator[int]:
    """Dispatch ``tr``'s ``CustomOp`` modules to ``forward_npu`` as on Ascend; yields how many were switched."""
    from vllm_omni.diffusion.layers.custom_op import CustomOp

    switched = [m for m in tr.modules() if isinstance(m, CustomOp) and "_forward_method" in m.__dict__]
    with contextlib.ExitStack() as patches:
        for m in switched:
            patches.enter_context(mock.patch.object(m, "_forward_method", m.forward_npu))
        yield len(switched)


def count_block(tr: Any, rt: Any, kw: dict[str, Any], flags: str, *, npu: bool) -> BlockCount:
    """Select ``flags`` on ``tr``, run one cold forward, then count the last block of a warm one."""
    from vllm_omni_ascend_opt import api
    from vllm_omni_ascend_opt.testbed.npu_ops import NpuOpCounter
    from vllm_omni_ascend_opt.testbed.opcount import OpCounter, count_module_calls

    counter = NpuOpCounter if npu else OpCounter
    api.select(flags, model=tr)
    try:
        with npu_dispatch(tr) if npu else contextlib.nullcontext(), rt.context(), torch.no_grad():
            tr(**kw)  # cold
            with count_module_calls(tr, counter) as whole, count_module_calls(tr.transformer_blocks[0], counter) as b0:
                with count_module_calls(tr.transformer_blocks[-1], counter) as calls:
                    tr(**kw)
    finally:
        api.select("none", model=tr)
    (c,), (first,), (call,) = calls, b0, whole
    if first.total < c.total:
        raise AssertionError(f"{flags}: block 0 launches {first.total}, fewer than the last block's {c.total}")
    # block 0 may launch more (once-per-forward work done lazily): that counts as outside the blocks
    unresolved = Counter(getattr(call, "unresolved", {}))
    return BlockCount(c.total, Counter(c.counts), unresolved, call.total, len(tr.transformer_blocks))


def ops_per_block(
    rt: Any, flags: str = "default", *, dtype: torch.dtype = torch.bfloat16, npu: bool = True
) -> BlockCount:
    """:func:`count_block` of the tiny transformer in ``dtype`` (``npu=True``: install the torch_npu fake first)."""
    tr = build_transformer(rt, TINY, dtype)
    return count_block(tr, rt, t2i_inputs(tr, dtype), flags, npu=npu)


def configurations() -> dict[str, str]:
    """The configurations the op tables report: stock, default, all, and each registered optimization alone."""
    from vllm_omni_ascend_opt import registry

    out = {"stock": "none", "default": "default", "all": "all"}
    out.update({o.name: f"none,+{o.name}" for o in registry.all_optimizations()})
    return out
