"""vLLM-Omni's own ``DiffusionModelRunner`` in this process, on the test bed's CPU runtime: its memory, cache, compile
and LoRA modes without an accelerator (CPU adaptations: the engine CPU runtime, unpinned offload memory, inductor
reported supported while a ``compile=True`` runner loads)."""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass
from typing import Any
from unittest import mock

import torch

from vllm_omni_ascend_opt.testbed.pipeline import decoded_images, make_request
from vllm_omni_ascend_opt.testbed.runtime import Runtime, apply_engine_cpu_runtime, use_import_workarounds


@dataclass
class RunnerHarness:
    """A loaded ``DiffusionModelRunner`` and the runtime it runs in."""

    runner: Any
    rt: Runtime
    lora_manager: Any = None

    @classmethod
    def load(
        cls, rt: Runtime, *, compile: bool = False, device: str | torch.device = "cpu", **fields: Any
    ) -> RunnerHarness:
        """A runner for ``rt``'s model with the ``OmniDiffusionConfig`` ``fields``, loaded on ``device``."""
        use_import_workarounds()
        apply_engine_cpu_runtime()
        from vllm_omni.diffusion.worker.diffusion_model_runner import DiffusionModelRunner
        from vllm_omni.platforms import current_omni_platform

        fields.setdefault("enforce_eager", not compile)
        od = copy.copy(rt.od_config)  # with ``fields`` set, cached resolutions dropped
        for name in [k for k in vars(od) if k.startswith("_resolved")]:
            delattr(od, name)  # e.g. the offload policy resolved for the runtime's own config
        offload = fields.get("enable_cpu_offload") or fields.get("enable_layerwise_offload")
        if offload and torch.accelerator.current_accelerator() is None:
            fields.setdefault("pin_cpu_memory", False)
        for name, value in fields.items():
            if not hasattr(od, name):
                raise TypeError(f"OmniDiffusionConfig has no field {name!r}")
            setattr(od, name, value)
        runner = DiffusionModelRunner(rt.vllm_config, od, torch.device(device))
        inductor = mock.patch.object(
            type(current_omni_platform), "supports_torch_inductor", classmethod(lambda _: True)
        )
        with rt.context(), inductor if compile else contextlib.nullcontext():  # else the runner skips compiling
            runner.load_model()
        return cls(runner, rt)

    @property
    def pipeline(self) -> Any:
        return self.runner.pipeline

    def enable_lora(self, max_cached_adapters: int = 2) -> Any:
        """The worker's ``init_lora_manager`` (PEFT backend) on this runner's pipeline."""
        from vllm_omni.diffusion.lora.manager import DiffusionLoRAManager

        self.lora_manager = DiffusionLoRAManager(
            pipeline=self.pipeline,
            device=torch.device("cpu"),
            dtype=self.rt.od_config.dtype,
            max_cached_adapters=max_cached_adapters,
        )
        return self.lora_manager

    def generate(
        self,
        prompt: str = "a red cat",
        *,
        height: int = 64,
        width: int = 64,
        steps: int = 4,
        seed: int = 42,
        lora: tuple[str, int, str, float] | None = None,
        **request: Any,
    ) -> torch.Tensor:
        """One request through ``runner.execute_model``: the decoded images ``[B, 3, H, W]``. ``lora`` (after
        :meth:`enable_lora`): the adapter (name, int id > 0, directory, scale), activated as the worker does."""
        if lora is not None and self.lora_manager is None:
            raise RuntimeError("generate(lora=...) needs enable_lora() first")
        if self.lora_manager is not None:
            from vllm_omni.lora.request import LoRARequest

            req = None if lora is None else LoRARequest(lora_name=lora[0], lora_int_id=lora[1], lora_path=lora[2])
            self.lora_manager.set_active_adapter(req, 1.0 if lora is None else lora[3])
        batch = make_request(prompt, height=height, width=width, steps=steps, seed=seed, **request)
        with self.rt.context():
            return decoded_images(self.runner.execute_model(batch.requests[0]))

    def close(self) -> None:
        """Drop the cache backend and the offloader's hooks (one cache-dit pipeline per process)."""
        for backend in (self.runner.cache_backend, self.runner.offload_backend):
            disable = getattr(backend, "disable", None)
            if callable(disable):
                with contextlib.suppress(Exception):
                    disable(self.runner.pipeline) if _takes_pipeline(disable) else disable()


def _takes_pipeline(fn: Any) -> bool:
    import inspect

    try:
        return len(inspect.signature(fn).parameters) >= 1
    except (TypeError, ValueError):
        return False
