"""Minimal CPU runtime for vLLM-Omni 0.30 (opt-in): on ``UnspecifiedOmniPlatform`` only, attention is routed to the
pure-torch SDPA; :func:`init_cpu_runtime` also creates the gloo group and parallel state as the diffusion worker does.
:func:`engine_env` and :func:`apply_engine_cpu_runtime` do the same for vLLM-Omni's own engines.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import logging
import os
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
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


def route_attention_to_sdpa_on_cpu() -> None:
    """On ``UnspecifiedOmniPlatform`` only: vLLM-Omni's SDPA backend, pure-torch forward (idempotent)."""
    from vllm_omni.diffusion.attention.backends.sdpa import SDPAImpl
    from vllm_omni.platforms import current_omni_platform

    plat_cls = type(current_omni_platform)
    if plat_cls.__name__ != "UnspecifiedOmniPlatform" or getattr(plat_cls, "_ascend_opt_cpu_routed", False):
        return
    sdpa = "vllm_omni.diffusion.attention.backends.sdpa.SDPABackend"
    plat_cls.get_diffusion_attn_backend_cls = classmethod(lambda cls, selected_backend=None, head_size=0, **_: sdpa)
    SDPAImpl.forward = lambda self, query, key, value, attn_metadata=None: self._forward_impl(
        query, key, value, attn_metadata
    )
    plat_cls._ascend_opt_cpu_routed = True


def route_ring_kernel_to_cpu() -> None:
    """Ring SP's ``_scaled_dot_product_efficient_attention`` (no CPU kernel) as its CPU twin (out, logsumexp)."""
    from vllm_omni.diffusion.attention.backends.ring import ring_kernels

    if getattr(ring_kernels, "_ascend_opt_cpu_routed", False):
        return
    original = ring_kernels._scaled_dot_product_efficient_attention

    def eff(q, k, v, attn_bias=None, compute_log_sumexp=True, dropout_p=0.0, is_causal=False, scale=None):
        if q.device.type != "cpu":
            return original(q, k, v, attn_bias, compute_log_sumexp, dropout_p, is_causal, scale)
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, dropout_p=dropout_p, is_causal=is_causal, scale=scale
        )[:2]

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
    """Create vLLM-Omni's configs and process groups for this process (idempotent). ``parallel``: fields of
    ``DiffusionParallelConfig``; with ``world_size > 1`` pass every rank the same ``init_method`` (``tcp://...``)."""
    if "rt" in _STATE:
        return _STATE["rt"]
    from vllm_omni.diffusion.data import DiffusionParallelConfig, OmniDiffusionConfig
    from vllm_omni.diffusion.distributed.parallel_state import init_distributed_environment, initialize_model_parallel
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
    rt = Runtime(od, create_diffusion_vllm_config(torch.device("cpu"), od), rank, world_size)
    init_method = init_method or f"tcp://127.0.0.1:{free_port()}"
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=init_method, world_size=world_size, rank=rank)
    with rt.context():
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
    _STATE["rt"] = rt
    return rt


def shutdown() -> None:
    """Tear down vLLM-Omni's groups and the process group (for spawned parallel workers)."""
    from vllm_omni.diffusion.distributed.parallel_state import destroy_distributed_env

    with contextlib.suppress(Exception):
        destroy_distributed_env()
    if dist.is_initialized():
        dist.destroy_process_group()
    _STATE.clear()


#: Opt-in switch. Set (with the site folder on PYTHONPATH) by :func:`engine_env` only.
ENV_CPU_RUNTIME = "VLLM_OMNI_ASCEND_OPT_CPU_RUNTIME"
#: Folder whose ``sitecustomize.py`` installs the import-time half in every process that inherits the environment.
SITE_DIR = Path(__file__).resolve().parent / "omni_cpu_site"

_engine_log = logging.getLogger("vllm_omni.ascend_opt.cpu_runtime")
_ENGINE_APPLIED: list[str] = []


def engine_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """``env`` (default: this process's) plus ``SITE_DIR`` on ``PYTHONPATH`` and ``ENV_CPU_RUNTIME=1``."""
    out = dict(os.environ if env is None else env)
    paths = [str(SITE_DIR)] + [p for p in out.get("PYTHONPATH", "").split(os.pathsep) if p and p != str(SITE_DIR)]
    out["PYTHONPATH"] = os.pathsep.join(paths)
    out[ENV_CPU_RUNTIME] = "1"
    out.setdefault("TOKENIZERS_PARALLELISM", "false")
    return out


@functools.cache
def _site_module() -> Any:
    spec = importlib.util.spec_from_file_location("_ascend_opt_cpu_site", SITE_DIR / "sitecustomize.py")
    site = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(site)  # type: ignore[union-attr]
    return site


def use_import_workarounds() -> None:
    """The torchvision-free image processors in this process (no audio placeholder). Idempotent."""
    _site_module().install_import_fallbacks(audio=False)


def engine_cpu_runtime_applied() -> list[str]:
    """What :func:`apply_engine_cpu_runtime` changed in this process (empty: nothing)."""
    return list(_ENGINE_APPLIED)


def apply_engine_cpu_runtime() -> list[str]:
    """Platform-time half of the engine CPU runtime, on ``UnspecifiedOmniPlatform`` only; idempotent. Returns what it
    changed: SDPA attention, CPU platform methods, the ``mp`` output thread on ``cpu``, unpinned LoRA memory."""
    if _ENGINE_APPLIED:
        return list(_ENGINE_APPLIED)
    from vllm_omni.platforms import current_omni_platform

    plat_cls = type(current_omni_platform)
    if plat_cls.__name__ != "UnspecifiedOmniPlatform":
        _engine_log.warning(
            "%s=1 but the platform is %s, not UnspecifiedOmniPlatform: the CPU runtime changes nothing",
            ENV_CPU_RUNTIME,
            plat_cls.__name__,
        )
        return []
    route_attention_to_sdpa_on_cpu()  # on this platform: always applied
    from vllm.platforms.interface import UnspecifiedPlatform

    for cls in dict.fromkeys((plat_cls, UnspecifiedPlatform)):
        for name, value in _PLATFORM_METHODS.items():
            setattr(cls, name, value)
    applied = ["attention->SDPA", "platform methods"]
    if torch.accelerator.current_accelerator() is None:
        import vllm.lora.lora_model as lora_model

        _cpu_async_output_thread()
        applied.append("mp async-output thread on cpu")
        if getattr(lora_model, "PIN_MEMORY", False):
            applied.append("LoRA without pinned memory")
        lora_model.PIN_MEMORY = False
    _ENGINE_APPLIED.extend(applied)
    _engine_log.info("CPU runtime for vLLM-Omni's engines (test-only): %s", ", ".join(applied))
    return applied


_NOOP, _ZERO = classmethod(lambda cls, *a, **k: None), classmethod(lambda cls, *a, **k: 0)
#: Platform methods unimplemented on CPU, set by :func:`apply_engine_cpu_runtime`.
_PLATFORM_METHODS = {
    "dist_backend": "gloo",
    "get_device_count": classmethod(lambda cls, *a, **k: 1),
    "set_device": _NOOP,
    "synchronize": _NOOP,
    "get_current_memory_usage": _ZERO,
    "max_memory_reserved": _ZERO,
    "max_memory_allocated": _ZERO,
    "reset_peak_memory_stats": _NOOP,
    "get_free_memory": classmethod(lambda cls, *a, **k: os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")),
}


def _cpu_async_output_thread() -> None:
    """The ``mp`` output thread of :func:`apply_engine_cpu_runtime` on ``cpu`` (idempotent)."""
    from vllm_omni.diffusion.worker import diffusion_worker as dw

    if getattr(dw.WorkerProc, "_ascend_opt_cpu_output", False):
        return
    in_output_thread = threading.local()
    real_current_accelerator = torch.accelerator.current_accelerator

    def current_accelerator(*args: Any, **kwargs: Any) -> Any:
        if getattr(in_output_thread, "on", False):
            return torch.device("cpu")
        return real_current_accelerator(*args, **kwargs)

    original_loop = dw.WorkerProc._async_output_loop
    original_pack = dw.pack_diffusion_output_shm

    def _async_output_loop(self: Any) -> Any:
        in_output_thread.on = True
        return original_loop(self)

    def pack_diffusion_output_shm(output: Any, d2h_stream: Any = None) -> Any:
        if d2h_stream is not None and torch.device(d2h_stream.device).type == "cpu":
            d2h_stream = None  # the caller still synchronizes its (CPU) stream: a no-op
        return original_pack(output, d2h_stream=d2h_stream)

    torch.accelerator.current_accelerator = current_accelerator
    dw.WorkerProc._async_output_loop = _async_output_loop
    dw.pack_diffusion_output_shm = pack_diffusion_output_shm
    dw.WorkerProc._ascend_opt_cpu_output = True
