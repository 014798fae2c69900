"""What an ablation generates and how often: the :class:`Workload`, named workload files and their lookup.

Values come, lowest priority first, from the defaults, a named workload file (TOML or JSON ``key = value`` pairs
named as :class:`Workload`'s fields; lookup: :func:`find_workload`) and the command line.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PACKAGE_WORKLOADS = Path(__file__).resolve().parents[1] / "workloads"
LOCAL_WORKLOADS = Path("ablations")

MODES = ("leave-one-out", "cumulative", "single")
ENGINES = ("auto", "testbed", "omni", "serve")
SCHEDULES = ("auto", "resident", "per-round")
STACKS = ("default", "all")
DTYPES = ("float32", "bfloat16", "float16")
ROUND_STATS = ("median", "mean", "min")
#: Fields with a fixed set of values, in the order ``validate`` reports them.
CHOICES = {
    "mode": MODES,
    "engine": ENGINES,
    "schedule": SCHEDULES,
    "stack": STACKS,
    "round_stat": ROUND_STATS,
    "dtype": DTYPES,
}


class WorkloadError(ValueError):
    """Bad workload values or a workload file that cannot be found or parsed (exit code 2)."""


@dataclass
class Workload:
    """Everything that defines one ablation run, except which optimizations take part."""

    name: str = "custom"
    description: str = ""
    #: ``tiny`` (the test-bed Qwen-Image), ``tiny-<variant>``, a local diffusers directory, or a Hugging Face id.
    model: str = "tiny"
    #: An edit pipeline's input image: a file path or ``sample`` (the test bed's 48x32 one); None for text-to-image.
    image: str | None = None
    engine: str = "auto"
    dtype: str = "float32"
    height: int = 64
    width: int = 64
    steps: int = 4
    cfg_scale: float = 1.0
    negative_prompt: str = " "
    prompts: list[str] = field(default_factory=lambda: ["a red cat sitting on a wooden chair"])
    seeds: list[int] = field(default_factory=lambda: [42, 43, 44])
    warmup: int = 2
    repeats: int = 2
    #: Text-encoder sequence cap; ``None``: 64 for the tiny model, 512 otherwise.
    max_sequence_length: int | None = None
    #: ``Omni(enforce_eager=...)``; the test-bed engine is always eager.
    enforce_eager: bool = True
    #: ``OmniDiffusionConfig`` fields (offload, VAE tiling, cache backend...): vLLM-Omni's modes for the run.
    od_config: dict[str, Any] = field(default_factory=dict)
    #: Also run stock without ``od_config``'s ``quantization_config`` (vLLM-Omni's int8): what the quantization
    #: itself costs in image quality and saves in time, reported as information, never judged (plan.INFORMATION).
    vs_unquantized: bool = False
    #: VAE tiles ``[min height, min width, stride height, stride width]`` in pixels (testbed only).
    vae_tiling: list[int] | None = None
    #: Testbed only: decode each image's latents this many times, timing the VAE decode stage as the fastest (the
    #: image is the first decode's; the generation's total leaves the extra decodes out).
    vae_decode_repeats: int = 1
    mode: str = "leave-one-out"
    stack: str = "default"
    round_stat: str = "median"
    ssim_gate: float = 0.99
    psnr_gate: float = 35.0
    min_improvement_pct: float = 1.0
    schedule: str = "auto"  # see schedule.py
    process_sets: int = 1
    #: SIGSTOP every worker's process group outside its own turn: idle engines keep polling threads.
    pause_idle: bool = False
    start_jobs: int = 2
    threads: int = 0  # torch threads per worker (0: torch's default)
    timeout_s: float = 600.0
    start_timeout_s: float = 1800.0

    @property
    def is_tiny(self) -> bool:
        return self.model == "tiny" or self.model.startswith("tiny-")

    def tiny_spec(self) -> Any:
        """The test bed's ModelSpec of a ``tiny`` / ``tiny-<variant>`` model (KeyError for an unknown variant)."""
        from vllm_omni_ascend_opt.testbed.tiny_model import TINY_FAMILY

        return TINY_FAMILY["t2i" if self.model == "tiny" else self.model[len("tiny-") :]]

    def seq_len(self) -> int:
        if self.max_sequence_length:
            return int(self.max_sequence_length)
        return 64 if self.is_tiny else 512

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def validate(self) -> Workload:
        """Raise :class:`WorkloadError` with a message a person can act on; return self."""
        problems: list[str] = []

        def need(ok: Any, problem: str) -> None:
            if not ok:
                problems.append(problem)

        for name, allowed in CHOICES.items():
            v = getattr(self, name)
            need(v in allowed, f"{name} {v!r} is not one of {', '.join(allowed)}")
        for name in ("height", "width"):
            v = getattr(self, name)
            need(
                isinstance(v, int) and v >= 16 and not v % 16,
                f"{name} must be a multiple of 16 and at least 16 (got {v!r}): Qwen-Image packs 2x2 latent patches "
                "of an 8x VAE",
            )
        need(_at_least(self.steps, 1), f"steps must be a positive integer (got {self.steps!r})")
        cfg = self.cfg_scale
        need(isinstance(cfg, (int, float)) and cfg >= 1.0, f"cfg_scale must be >= 1 (1 disables true CFG; got {cfg!r})")
        prompts_ok = self.prompts and all(isinstance(p, str) and p.strip() for p in self.prompts)
        need(prompts_ok, "at least one non-empty prompt is needed")
        bad_seeds = not self.seeds or not all(_at_least(s, 0) for s in self.seeds)
        need(not bad_seeds, f"seeds must be non-negative integers (got {self.seeds!r})")
        need(bad_seeds or len(set(self.seeds)) == len(self.seeds), f"seeds must be distinct (got {self.seeds!r})")
        for name, low in (
            ("warmup", 0),
            ("repeats", 1),
            ("process_sets", 1),
            ("start_jobs", 1),
            ("vae_decode_repeats", 1),
        ):
            need(_at_least(getattr(self, name), low), f"{name} must be >= {low} (got {getattr(self, name)!r})")
        need(0.0 < float(self.ssim_gate) <= 1.0, f"the SSIM gate must be in (0, 1] (got {self.ssim_gate!r})")
        need(float(self.psnr_gate) > 0, f"the PSNR gate must be positive dB (got {self.psnr_gate!r})")
        need(self.timeout_s > 0 and self.start_timeout_s > 0, "timeouts must be positive")
        msl = self.max_sequence_length
        need(msl is None or int(msl) >= 1, "max_sequence_length must be positive")
        need(self.model == "tiny" or self.model.strip(), "model must be 'tiny', a directory or a Hugging Face id")
        if self.is_tiny:
            from vllm_omni_ascend_opt.testbed.tiny_model import TINY_FAMILY

            variants = ["tiny", *(f"tiny-{k}" for k in TINY_FAMILY if k != "t2i")]
            if self.model not in variants:
                problems.append(f"model {self.model!r} is not one of the embedded ones ({', '.join(variants)})")
            elif self.tiny_spec().image_input and not self.image:
                problems.append(f"model {self.model!r} edits an input image: set image (a path or 'sample')")
        if not isinstance(self.od_config, dict):
            problems.append(f"od_config must be a table of OmniDiffusionConfig fields (got {self.od_config!r})")
        elif self.od_config:
            try:
                from vllm_omni.diffusion.data import OmniDiffusionConfig

                known = {f.name for f in dataclasses.fields(OmniDiffusionConfig)}
            except ImportError:  # the planner runs without vLLM-Omni in some tests: the worker checks then
                known = set(self.od_config)
            bad = sorted(set(self.od_config) - known)
            need(not bad, f"od_config: OmniDiffusionConfig has no field(s) {', '.join(bad)}")
        quantized = isinstance(self.od_config, dict) and self.od_config.get("quantization_config")
        need(
            not self.vs_unquantized or quantized,
            "vs_unquantized compares stock with and without od_config's quantization_config, which this workload "
            "does not set",
        )
        tiles = self.vae_tiling
        need(
            tiles is None
            or (isinstance(tiles, list) and len(tiles) == 4 and all(_at_least(v, 1) and v % 8 == 0 for v in tiles)),
            "vae_tiling must be [min height, min width, stride height, stride width], positive multiples of 8 "
            f"(got {tiles!r})",
        )
        im = self.image
        need(im is None or (isinstance(im, str) and im.strip()), f"image must be a file path or 'sample' (got {im!r})")
        if problems:
            raise WorkloadError("invalid workload " + repr(self.name) + ": " + "; ".join(problems))
        return self


FIELDS = {f.name for f in dataclasses.fields(Workload)}


def _at_least(v: Any, low: int) -> bool:
    return isinstance(v, int) and v >= low


def from_mapping(data: dict[str, Any], name: str = "custom", base: Workload | None = None) -> Workload:
    """A workload from ``data`` over ``base`` (defaults when None); unknown keys are an error."""
    unknown = sorted(set(data) - FIELDS)
    if unknown:
        raise WorkloadError(
            f"workload {name!r}: unknown key(s) {', '.join(unknown)}; valid keys: {', '.join(sorted(FIELDS))}"
        )
    wl = dataclasses.replace(base or Workload(), **data)
    if "name" not in data:
        wl.name = name
    for key in ("prompts", "seeds", "vae_tiling"):
        v = getattr(wl, key)
        if isinstance(v, tuple):
            setattr(wl, key, list(v))
    return wl


def find_workload(name: str) -> Path:
    """The workload file ``name``: a path, else ``NAME.toml`` / ``.json`` in ./ablations/, then in the package."""
    p = Path(name)
    if p.suffix in (".toml", ".json") and p.is_file():
        return p
    for root in (LOCAL_WORKLOADS, PACKAGE_WORKLOADS):
        for ext in (".toml", ".json"):
            cand = root / f"{name}{ext}"
            if cand.is_file():
                return cand
    raise WorkloadError(f"no workload named {name!r}; available: {', '.join(available_workloads()) or 'none'}")


def available_workloads() -> list[str]:
    names = set()
    for root in (LOCAL_WORKLOADS, PACKAGE_WORKLOADS):
        if root.is_dir():
            names.update(p.stem for p in root.iterdir() if p.suffix in (".toml", ".json"))
    return sorted(names)


def load_workload(name: str) -> Workload:
    path = find_workload(name)
    text = path.read_text(encoding="utf-8")
    try:
        data = json.loads(text) if path.suffix == ".json" else parse_toml(text)
    except ValueError as exc:  # JSONDecodeError and TOMLDecodeError included
        raise WorkloadError(f"cannot parse workload file {path}: {exc}") from None
    if not isinstance(data, dict):
        raise WorkloadError(f"workload file {path} must hold a table of key = value pairs")
    return from_mapping(data, name=path.stem)


def parse_toml(text: str) -> dict[str, Any]:
    """``tomllib`` on Python >= 3.11, ``tomli`` (in the ``ablation`` extra) on 3.10."""
    if sys.version_info >= (3, 11):
        import tomllib

        return tomllib.loads(text)
    try:
        import tomli  # type: ignore[import-not-found]
    except ImportError:
        raise WorkloadError(
            "reading TOML workloads on Python 3.10 needs tomli: pip install 'vllm-omni-ascend-opt[ablation]' "
            "(or use a .json workload)"
        ) from None
    return tomli.loads(text)
