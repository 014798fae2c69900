"""vLLM-Omni's memory and cache modes through its ``DiffusionModelRunner`` (tests/test_memory_modes.py): one request
twice; cache-dit enables once per process, so its modes run in children (``python -m tests.runner_modes``)."""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

#: The request every mode runs twice.
REQUEST = {"height": 64, "width": 64, "steps": 8, "cfg_scale": 4.0, "seed": 42}
#: Block forwards of one request without a cache backend: 8 steps x 2 CFG branches x 2 blocks.
BLOCK_CALLS = 8 * 2 * 2
#: VAE tiles that really tile the tiny VAE (compression 4) at 64x64: 8-latent tiles every 6 latents, 3x3 tiles.
TILES = (32, 32, 24, 24)
#: Statistics that show an optimization ran (CPU: the exact default stack), for "status matches what ran".
EVIDENCE = {
    "shared_modulation": ("hits", "misses"),
    "rope": ("portable_calls", "kernel_calls"),
    "joint_attention": ("joint_calls",),
    "vae_exact": ("single_frame_decodes", "tiled_decodes"),
}
#: What memo_aware_offload counts where the mode offloads layerwise (its ``needs_config``): the skipping forwards.
OFFLOAD_EVIDENCE = {"memo_aware_offload": ("forwards_skipping",)}


def evidence(mode: str) -> dict[str, tuple[str, ...]]:
    """The optimizations that act on CPU in ``mode`` (default stack), each with the counters that show it worked."""
    return {**EVIDENCE, **(OFFLOAD_EVIDENCE if MODES[mode].fields.get("enable_layerwise_offload") else {})}


@dataclass(frozen=True)
class Mode:
    """``OmniDiffusionConfig`` fields, request fields, the VAE tiles, whether it needs its own process."""

    fields: dict[str, Any]
    sampling: dict[str, Any] = field(default_factory=dict)
    tiles: tuple[int, int, int, int] | None = None
    own_process: bool = False


def _cache_dit(**config: Any) -> Mode:
    return Mode({"cache_backend": "cache_dit", "cache_config": {"max_warmup_steps": 2, **config}}, own_process=True)


MODES: dict[str, Mode] = {
    "vae_slicing": Mode({"vae_use_slicing": True}, sampling={"num_outputs_per_prompt": 2}),
    "vae_tiling": Mode({"vae_use_tiling": True}, tiles=TILES),
    "layerwise_offload": Mode({"enable_layerwise_offload": True}),
    "model_cpu_offload": Mode({"enable_cpu_offload": True}),
    "tea_cache": Mode({"cache_backend": "tea_cache", "cache_config": {"rel_l1_thresh": 0.6}}),
    # no built-in table for QwenImageTransformer2DModel: explicit ratios (all 1: any step after the retained ones)
    "mag_cache": Mode(
        {
            "cache_backend": "mag_cache",
            "cache_config": {"mag_ratios": [1.0] * 8, "mag_threshold": 0.5, "mag_retention_ratio": 0.2},
        }
    ),
    "cache_dit_dbcache": _cache_dit(residual_diff_threshold=0.5),
    "cache_dit_taylorseer": _cache_dit(residual_diff_threshold=0.5, enable_taylorseer=True),
    "cache_dit_scm": _cache_dit(scm_steps_mask_policy="ultra", scm_steps_policy="static"),
}


@dataclass
class ModeRun:
    """What one (mode, selection) run produced: both images, the warm request's statistics and status."""

    mode: str
    spec: str
    images: list[torch.Tensor]
    stats: dict[str, dict[str, int]]
    fallbacks: dict[str, dict[str, int]]
    acting: list[str]
    reasons: dict[str, list[str]]
    #: the runner's backends: {"offload": class name or None, "cache": class name or None}
    backends: dict[str, str | None] = field(default_factory=dict)

    def ran(self, name: str) -> int:
        """How much ``name``'s evidence counters counted on the warm request."""
        return sum(self.stats.get(name, {}).get(k, 0) for k in evidence(self.mode).get(name, ()))

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("images")
        return d


def run_mode(runtime: Any, mode: str, spec: str) -> ModeRun:
    """Load the tiny model through vLLM-Omni's runner in ``mode`` with ``spec`` selected; two identical requests."""
    from tests.harness.runner import loaded
    from vllm_omni_ascend_opt import _report, registry

    m = MODES[mode]
    with loaded(runtime, spec, **m.fields) as h:
        if m.tiles is not None:
            h.pipeline.vae.enable_tiling(*m.tiles)
        images = [h.generate(**REQUEST, **m.sampling)]
        for opt in registry.all_optimizations():
            opt.reset_stats()
        images.append(h.generate(**REQUEST, **m.sampling))
        opts = registry.all_optimizations()
        return ModeRun(
            mode=mode,
            spec=spec,
            images=images,
            stats={o.name: dict(o.stats) for o in opts if o.stats},
            fallbacks={o.name: o.fallback_reasons() for o in opts if o.fallback_reasons()},
            acting=_report.acting(h.pipeline),
            reasons={o.name: _report.explain(o, h.pipeline) for o in opts},
            backends={
                "offload": _enabled_backend(h.runner.offload_backend),
                "cache": _enabled_backend(h.runner.cache_backend),
            },
        )


def _enabled_backend(backend: Any) -> str | None:
    return type(backend).__name__ if backend is not None and getattr(backend, "enabled", True) else None


def run_in_children(mode: str, specs: list[str], root: Path) -> dict[str, ModeRun]:
    """:func:`run_mode` for each of ``specs``, all at once, each in a fresh interpreter (cache-dit: one per process)."""
    import os
    import subprocess

    repo = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(repo), os.environ.get("PYTHONPATH", "")]))
    procs = {}
    for spec in specs:
        (root / spec).mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "tests.runner_modes", mode, spec, str(root / spec)]
        with open(root / spec / "stderr.txt", "wb") as err:  # a file: a full pipe would stall a talkative child
            procs[spec] = subprocess.Popen(
                cmd, cwd=repo, env=env, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True
            )
    try:
        for proc in procs.values():
            proc.wait(timeout=1800)  # a hang guard
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
                proc.wait()
    out = {}
    for spec, proc in procs.items():
        if proc.returncode != 0:
            err = (root / spec / "stderr.txt").read_text(errors="replace")
            raise AssertionError(f"{mode} / {spec} failed (exit {proc.returncode}):\n{err[-4000:]}")
        data = json.loads((root / spec / "run.json").read_text())
        out[spec] = ModeRun(images=torch.load(root / spec / "images.pt"), **data)
    return out


def main() -> None:
    mode, spec, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    from vllm_omni_ascend_opt.testbed import build_model_dir
    from vllm_omni_ascend_opt.testbed.runtime import init_cpu_runtime

    torch.set_num_threads(1)
    run = run_mode(init_cpu_runtime(str(build_model_dir())), mode, spec)
    out.mkdir(parents=True, exist_ok=True)
    torch.save(run.images, out / "images.pt")
    (out / "run.json").write_text(json.dumps(run.to_json()))


if __name__ == "__main__":
    main()
