"""Minimal CPU runtime for vLLM-Omni 0.30 (opt-in; separate from the NPU optimizations).

vLLM-Omni 0.30 has no CPU platform. Without an accelerator it resolves ``UnspecifiedOmniPlatform``, whose diffusion
attention-backend selection and ``AttentionImpl.forward`` dispatch raise ``NotImplementedError``. On such a
machine only, :func:`init_cpu_runtime` routes both to vLLM-Omni's own pure-torch SDPA implementation, creates the gloo
process group itself (vLLM-Omni's own init does ``rank % device_count()``, which is 0 on CPU), and initialises
vLLM-Omni's parallel state exactly as ``diffusion_worker.py`` does. On a machine with an accelerator platform it
changes nothing in vLLM-Omni and only sets up the groups.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

_STATE: dict[str, Any] = {}


@dataclass
class Runtime:
    od_config: Any
    vllm_config: Any
    rank: int = 0
    world_size: int = 1

    @contextlib.contextmanager
    def context(self) -> Iterator[Any]:
        """vLLM config + diffusion config + forward context: wrap model construction and every forward call."""
        from vllm.config import set_current_vllm_config
        from vllm_omni.diffusion.config import set_current_diffusion_config
        from vllm_omni.diffusion.forward_context import set_forward_context

        with (
            set_current_vllm_config(self.vllm_config),
            set_current_diffusion_config(self.od_config),
            set_forward_context(vllm_config=self.vllm_config, omni_diffusion_config=self.od_config),
        ):
            yield self.od_config


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def route_attention_to_sdpa_on_cpu() -> bool:
    """On ``UnspecifiedOmniPlatform`` only: select vLLM-Omni's SDPA backend and run its pure-torch forward.

    Returns True when it changed something. Idempotent.
    """
    from vllm_omni.diffusion.attention.backends.sdpa import SDPAImpl
    from vllm_omni.platforms import current_omni_platform

    plat_cls = type(current_omni_platform)
    if plat_cls.__name__ != "UnspecifiedOmniPlatform":
        return False
    if getattr(plat_cls, "_ascend_opt_cpu_routed", False):
        return True

    def get_diffusion_attn_backend_cls(cls, selected_backend=None, head_size=0, **_: Any) -> str:
        return "vllm_omni.diffusion.attention.backends.sdpa.SDPABackend"

    def forward(self, query, key, value, attn_metadata=None):
        return self._forward_impl(query, key, value, attn_metadata)

    plat_cls.get_diffusion_attn_backend_cls = classmethod(get_diffusion_attn_backend_cls)
    SDPAImpl.forward = forward
    plat_cls._ascend_opt_cpu_routed = True
    return True


def route_ring_kernel_to_cpu() -> None:
    """Ring SP's pure-torch path calls ``aten._scaled_dot_product_efficient_attention`` (no CPU kernel). On CPU the
    op returning (out, logsumexp) in the same layout is ``aten._scaled_dot_product_flash_attention_for_cpu``."""
    from vllm_omni.diffusion.attention.backends.ring import ring_kernels

    if getattr(ring_kernels, "_ascend_opt_cpu_routed", False):
        return
    original = ring_kernels._scaled_dot_product_efficient_attention

    def eff(q, k, v, attn_bias=None, compute_log_sumexp=True, dropout_p=0.0, is_causal=False, scale=None):
        if q.device.type != "cpu":
            return original(q, k, v, attn_bias, compute_log_sumexp, dropout_p, is_causal, scale)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, dropout_p=dropout_p, is_causal=is_causal, scale=scale
        )[:2]
        return out, lse

    ring_kernels._scaled_dot_product_efficient_attention = eff
    ring_kernels._ascend_opt_cpu_routed = True


def init_cpu_runtime(
    model: str | None = None,
    *,
    dtype: torch.dtype = torch.float32,
    parallel: dict[str, int] | None = None,
    rank: int = 0,
    world_size: int = 1,
    init_method: str | None = None,
    **od_kwargs: Any,
) -> Runtime:
    """Create vLLM-Omni's configs and process groups for this process (idempotent within a process).

    ``parallel`` holds ``DiffusionParallelConfig`` fields (``ulysses_degree=2``, ``cfg_parallel_size=2``, ...);
    with ``world_size > 1`` pass the same ``init_method`` (``tcp://127.0.0.1:PORT``) to every rank.
    """
    if "rt" in _STATE:
        return _STATE["rt"]
    from vllm.config import set_current_vllm_config
    from vllm_omni.diffusion.data import DiffusionParallelConfig, OmniDiffusionConfig
    from vllm_omni.diffusion.distributed.parallel_state import (
        init_distributed_environment,
        initialize_model_parallel,
    )
    from vllm_omni.diffusion.forward_context import set_forward_context
    from vllm_omni.diffusion.vllm_config import create_diffusion_vllm_config

    route_attention_to_sdpa_on_cpu()
    pc = DiffusionParallelConfig(**(parallel or {}))
    if pc.ring_degree > 1:
        route_ring_kernel_to_cpu()
    od = OmniDiffusionConfig(
        model=model,
        model_class_name=None if model else "QwenImagePipeline",
        num_gpus=world_size,
        parallel_config=pc,
        dtype=dtype,
        **od_kwargs,
    )
    if model:
        od.enrich_config()
    vc = create_diffusion_vllm_config(torch.device("cpu"), od)
    init_method = init_method or f"tcp://127.0.0.1:{free_port()}"
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=init_method, world_size=world_size, rank=rank)
    with set_forward_context(vllm_config=vc, omni_diffusion_config=od), set_current_vllm_config(vc):
        init_distributed_environment(
            world_size=world_size, rank=rank, local_rank=rank, distributed_init_method=init_method, backend="gloo"
        )
        p = od.parallel_config
        initialize_model_parallel(
            data_parallel_size=p.data_parallel_size,
            cfg_parallel_size=p.cfg_parallel_size,
            sequence_parallel_size=p.sequence_parallel_size,
            ulysses_degree=p.ulysses_degree,
            ring_degree=p.ring_degree,
            tensor_parallel_size=p.tensor_parallel_size,
            backend="gloo",
        )
    rt = Runtime(od, vc, rank, world_size)
    _STATE["rt"] = rt
    return rt


def current_runtime() -> Runtime:
    try:
        return _STATE["rt"]
    except KeyError:
        raise RuntimeError("call init_cpu_runtime() first") from None


def shutdown() -> None:
    """Tear down vLLM-Omni's groups and the process group (for spawned parallel workers)."""
    from vllm_omni.diffusion.distributed.parallel_state import destroy_distributed_env

    with contextlib.suppress(Exception):
        destroy_distributed_env()
    if dist.is_initialized():
        dist.destroy_process_group()
    _STATE.clear()
