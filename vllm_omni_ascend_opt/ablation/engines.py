"""The ablation worker's engines (``testbed``, ``omni``, ``serve``: docs/ablation.md, "Engines: which one when"):
``load()``, ``generate(prompt, seed) -> Generation``, ``active()`` (None: unknown), ``model_reasons(name)``, ``close()``."""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


def sampling(job: dict[str, Any]) -> dict[str, Any]:
    """The job's sampling settings, as both test-bed request builders take them."""
    return {k: job[k] for k in ("height", "width", "steps", "cfg_scale", "negative_prompt")}


@dataclass
class Generation:
    uint8: Any  # numpy [H, W, 3]
    float_chw: Any | None  # numpy float32 [3, H, W] in [-1, 1], or None
    total_ms: float
    stages_ms: dict[str, float] = field(default_factory=dict)
    cpu_ms: float | None = None  # CPU time of this process (all threads) during the generation


def pick_device() -> str:
    """The accelerator this process would use (``_backend`` is the one place that decides about torch_npu)."""
    import torch

    from vllm_omni_ascend_opt import _backend

    if _backend.torch_npu_module() is not None:
        return str(_backend.npu_device())
    return "cuda:0" if torch.cuda.is_available() else "cpu"


def input_image(spec: str | None) -> Any:
    """The workload's input image: None, ``sample`` (the test bed's) or a file path, as an RGB PIL image."""
    if not spec:
        return None
    if spec == "sample":
        from vllm_omni_ascend_opt.testbed.pipeline import sample_image

        return sample_image(0)
    from PIL import Image

    with Image.open(spec) as im:
        return im.convert("RGB")


def _same_output(a: Any, b: Any) -> bool:
    """Whether two ``_decode_latents`` results hold the same image tensor (bit for bit)."""
    import torch

    x, y = getattr(a, "output", a), getattr(b, "output", b)
    if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
        return x.shape == y.shape and torch.equal(x, y)
    return type(x) is type(y)


#: The test-bed pipeline's methods timed as our stages.
TESTBED_STAGES = {"encode_prompt": "text_encode", "diffuse": "denoise", "_decode_latents": "vae_decode"}


class TestbedEngine:
    def __init__(self, job: dict[str, Any]) -> None:
        self.job = job
        self.device = pick_device()
        self.stages: dict[str, float] = {}
        self.extra_ms = 0.0  # time of the repeated VAE decodes, not part of the generation
        self.harness: Any = None

    def load(self) -> None:
        import torch

        from vllm_omni_ascend_opt.testbed.pipeline import load_pipeline
        from vllm_omni_ascend_opt.testbed.runtime import init_cpu_runtime

        self.rt = init_cpu_runtime(self.job["model_path"], dtype=getattr(torch, self.job["dtype"]))
        modes = dict(self.job.get("od_config") or {})
        tiles = self.job.get("vae_tiling")
        if tiles:
            modes.setdefault("vae_use_tiling", True)
        if modes:  # vLLM-Omni's memory / cache modes: its own runner applies them (offload, cache backend, ...)
            from vllm_omni_ascend_opt.testbed.model_runner import RunnerHarness

            self.harness = RunnerHarness.load(self.rt, device=self.device, **modes)
            self.pipe = self.harness.pipeline
        else:
            self.pipe = load_pipeline(self.rt, device=self.device)
        if tiles:
            self.pipe.vae.enable_tiling(*tiles)
        if hasattr(self.pipe, "set_progress_bar_config"):
            self.pipe.set_progress_bar_config(disable=True)
        for method, stage in TESTBED_STAGES.items():
            if hasattr(self.pipe, method):  # the edit pipelines decode inline (no _decode_latents)
                setattr(self.pipe, method, self._timed(stage, getattr(self.pipe, method)))

    def _sync(self) -> None:
        from vllm_omni_ascend_opt import _backend

        _backend.synchronize(self.device)

    def _timed(self, stage: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        repeats = max(1, int(self.job.get("vae_decode_repeats") or 1)) if stage == "vae_decode" else 1

        def once(*args: Any, **kwargs: Any) -> tuple[Any, float]:
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            self._sync()
            return out, (time.perf_counter() - t0) * 1e3

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            # ``vae_decode_repeats``: the same latents decoded again; the stage is the fastest decode, the image the
            # first one's, and the generation's total leaves the extra decodes out (see docs/ablation.md)
            self._sync()  # each decode ends synchronized: only the first needs it before
            t_all = time.perf_counter()
            out, best = once(*args, **kwargs)
            for _ in range(repeats - 1):
                again, ms = once(*args, **kwargs)
                if not _same_output(out, again):
                    raise RuntimeError("vae_decode_repeats: decoding the same latents again gave another image")
                best = min(best, ms)
            self.extra_ms += (time.perf_counter() - t_all) * 1e3 - best
            self.stages[stage] = self.stages.get(stage, 0.0) + best
            return out

        wrapper.__wrapped__ = fn  # type: ignore[attr-defined]
        return wrapper

    def active(self) -> list[str]:
        """Optimizations acting on the loaded pipeline (the plugin's own answer)."""
        from vllm_omni_ascend_opt import _report

        return _report.acting(self.pipe)

    def model_reasons(self, name: str) -> list[str]:
        from vllm_omni_ascend_opt import _report, registry

        return _report.explain(registry.get(name), self.pipe)

    def generate(self, prompt: str, seed: int) -> Generation:
        import torch

        from vllm_omni_ascend_opt.testbed.pipeline import make_request, pre_process_func, run_forward

        j = self.job
        image = input_image(j.get("image"))
        req = make_request(
            prompt,
            seed=seed,
            **sampling(j),
            max_sequence_length=j["max_sequence_length"],
            image=image,
            pre_process=pre_process_func(self.pipe) if image is not None else None,
        )
        self.stages, self.extra_ms = {}, 0.0
        with self.rt.context(), torch.no_grad():
            self._sync()
            c0, t0 = time.process_time(), time.perf_counter()
            if self.harness is not None:  # the runner refreshes the cache backend per request
                outs = self.harness.runner.execute_model(req.requests[0])
            else:
                outs = run_forward(self.pipe, req)
            self._sync()
            total = (time.perf_counter() - t0) * 1e3 - self.extra_ms
            cpu = (time.process_time() - c0) * 1e3
        images = (outs[0] if isinstance(outs, list) else outs).output
        x = (images[0] if images.dim() == 4 else images).detach().float().cpu()  # [3, H, W] in [-1, 1]
        # vLLM-Omni's post-processing of its "pt" output
        uint8 = ((x / 2 + 0.5).clamp(0, 1).permute(1, 2, 0) * 255).round().to(torch.uint8).numpy()
        return Generation(uint8, x.numpy(), total, dict(self.stages), cpu)

    def memory(self) -> dict[str, dict[str, int]]:
        """Peak bytes of one transformer forward and one VAE decode on a warm request (never a timed sample)."""
        from vllm_omni_ascend_opt.testbed.memory import first_call_peaks, pipeline_targets

        prompt, seed = self.job["prompts"][0], int((self.job.get("seeds") or [0])[0])
        self.generate(prompt, seed)
        with first_call_peaks(pipeline_targets(self.pipe), device=self.device) as peaks:
            self.generate(prompt, seed)
        return {label: {"peak": p.peak, "end": p.end} for label, p in peaks.items()}

    def close(self) -> None:
        if self.harness is not None:
            self.harness.close()


#: vLLM-Omni profiler stage names (suffixes of ``<Pipeline>.<path>``) -> our stage names.
OMNI_STAGE_SUFFIXES = {".text_encoder.forward": "text_encode", ".diffuse": "denoise", ".vae.decode": "vae_decode"}


def omni_stages_ms(stage_durations: dict[str, float] | None) -> dict[str, float]:
    """Map vLLM-Omni's ``stage_durations`` (seconds, keyed ``QwenImagePipeline.diffuse`` ...) to ours (ms)."""
    out: dict[str, float] = {}
    for key, secs in (stage_durations or {}).items():
        for suffix, stage in OMNI_STAGE_SUFFIXES.items():
            if key.endswith(suffix):
                out[stage] = out.get(stage, 0.0) + float(secs) * 1e3
    return out


class _StatusFileEngine:
    """Engines whose model lives in vLLM-Omni's processes: what acts there comes from the plugin's status file."""

    def __init__(self, job: dict[str, Any]) -> None:
        from vllm_omni_ascend_opt._report import ENV_STATUS_FILE

        self.job = job
        self.device = pick_device()
        base = Path(os.environ.get("TMPDIR") or "/tmp")
        cid = (self.job.get("config") or {}).get("id", "engine")
        self.status_path = base / f"ascend-opt-status-{os.getpid()}-{cid}.json"
        self.status_path.unlink(missing_ok=True)
        os.environ[ENV_STATUS_FILE] = str(self.status_path)  # inherited by every engine process

    def status(self) -> dict[str, Any] | None:
        with contextlib.suppress(OSError, ValueError):
            return json.loads(self.status_path.read_text())
        return None

    def active(self) -> list[str] | None:
        st = self.status()
        if st is None:
            raise RuntimeError(f"the engine wrote no plugin status file ({self.status_path}): was the plugin loaded?")
        return list(st.get("acting_on_pipeline") or [])

    def model_reasons(self, name: str) -> list[str]:
        st = self.status() or {}
        why = (st.get("reasons") or {}).get(name)
        if why is None:
            off = (st.get("off") or {}).get(name)
            why = [off or "installed but not acting on the pipeline"]
        return [f"in the engine process {st.get('pid')}: {w}" for w in why]


class OmniEngine(_StatusFileEngine):
    def load(self) -> None:
        from vllm_omni.entrypoints.omni import Omni

        j = self.job
        self.omni = Omni(
            model=j["model_path"] or j["model"],
            dtype=j["dtype"],
            enforce_eager=bool(j["enforce_eager"]),
            enable_diffusion_pipeline_profiler=True,
            **(j.get("od_config") or {}),  # the workload's vLLM-Omni modes
        )

    def generate(self, prompt: str, seed: int) -> Generation:
        import numpy as np
        import torch
        from vllm_omni.diffusion.utils.image_output import extract_images_from_outputs
        from vllm_omni.inputs.data import OmniDiffusionSamplingParams
        from vllm_omni.platforms import current_omni_platform

        j = self.job
        sp = OmniDiffusionSamplingParams(
            height=j["height"],
            width=j["width"],
            num_inference_steps=j["steps"],
            seed=seed,
            generator=torch.Generator(device=current_omni_platform.device_type or "cpu").manual_seed(seed),
            true_cfg_scale=j["cfg_scale"],
            max_sequence_length=j["max_sequence_length"],
        )
        p: Any = prompt
        if j["cfg_scale"] > 1.0:
            p = {"prompt": prompt, "negative_prompt": j["negative_prompt"]}
        image = input_image(j.get("image"))
        if image is not None:  # image editing: vLLM-Omni's pre-process reads multi_modal_data
            p = {"prompt": prompt, **(p if isinstance(p, dict) else {}), "multi_modal_data": {"image": image}}
        t0 = time.perf_counter()
        outs = self.omni.generate(p, sampling_params_list=[sp], use_tqdm=False)
        total = (time.perf_counter() - t0) * 1e3
        images = extract_images_from_outputs(outs)
        if not images:
            raise RuntimeError(f"Omni.generate returned no image: {outs!r}"[:2000])
        uint8 = np.asarray(images[0].convert("RGB"), dtype=np.uint8)
        durations = getattr(outs[0], "stage_durations", None) if outs else None
        return Generation(uint8=uint8, float_chw=None, total_ms=total, stages_ms=omni_stages_ms(durations))

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.omni.close()


def serve_stages_ms(stage_durations: dict[str, float] | None) -> dict[str, float]:
    """The profiler's stages as for ``omni``, plus ``server_generate``: the server-side time without HTTP."""
    out = omni_stages_ms(stage_durations)
    gen = [float(v) for k, v in (stage_durations or {}).items() if k.startswith("stage_") and k.endswith("_gen_ms")]
    if gen:
        out["server_generate"] = sum(gen)
    return out


class ServeEngine(_StatusFileEngine):
    server: Any = None

    def load(self) -> None:
        from vllm_omni_ascend_opt.testbed.serve import OmniServer

        j = self.job
        # The server inherits this process's flags, writes to its stderr (the configuration's log) and stays in its
        # process group (the runner's group kill ends it); executor: vLLM-Omni's default, as `vllm serve --omni`.
        self.server = OmniServer(
            j["model_path"] or j["model"],
            log_path=None,
            dtype=j["dtype"],
            enforce_eager=bool(j["enforce_eager"]),
            mp=False,
            new_session=False,
            extra_args=["--enable-diffusion-pipeline-profiler"],  # per-stage stage_durations in each response
        )
        self.server.start()
        self.server.wait_ready(timeout=float(j.get("start_timeout_s") or 1800.0))

    def generate(self, prompt: str, seed: int) -> Generation:
        from vllm_omni_ascend_opt.testbed.serve import image_request

        j = self.job
        body = image_request(prompt, seed=seed, **sampling(j))
        r = self.server.generate(body, timeout=float(j.get("timeout_s") or 600.0))
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status} from the server: {json.dumps(r.body)[:2000]}")
        return Generation(r.image(), None, r.latency_s * 1e3, serve_stages_ms(r.stage_durations()))

    def close(self) -> None:
        if self.server is not None:
            self.server.stop()


ENGINES = {"testbed": TestbedEngine, "omni": OmniEngine, "serve": ServeEngine}
