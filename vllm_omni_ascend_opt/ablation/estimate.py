"""Estimated ms saved on a 910B1 (a model, NOT a measurement): batch-1 eager Qwen-Image on an Ascend NPU is bound
by kernel launches, so launches saved (:data:`TABLE_FILE`) x a per-launch cost (:func:`calibration`); docs/results.md
explains both. Faster kernels count only their launches."""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_omni_ascend_opt.devtime import model as _published

TABLE_FILE = Path(__file__).with_name("npu_launches.json")
QWEN_IMAGE_BLOCKS = 60
#: The reference's published 910B1 measurement (BF16, eager, 1280x704, 8 steps, CFG off), in ms: the figures are the
#: device-time model's calibration points (devtime/model.py owns them).
REFERENCE = {
    "stock_ms": _published.REFERENCE_MS["stock"],
    "steps": _published.REFERENCE_STEPS,
    "cfg_forwards": 1,
    "rope_ms": _published.REFERENCE_MS["stock"] - _published.REFERENCE_MS["rope"],
    "modulation_ms": _published.REFERENCE_MS["stock"] - _published.REFERENCE_MS["shared_modulation"],
}
USED = "rope"
LABEL = "estimated ms saved on a 910B1 (model, not measured)"


@functools.cache
def load_table(path: Path = TABLE_FILE) -> dict[str, Any]:
    return json.loads(path.read_text())


def transformer_opts(names: list[str] | tuple[str, ...] | None = None) -> list[str]:
    """The registered optimizations that patch the transformer module (in registry order)."""
    from vllm_omni_ascend_opt import registry
    from vllm_omni_ascend_opt.blocks.upstream import targets

    return registry.patching(targets.TRANSFORMER, names)


def key(opts: list[str] | tuple[str, ...]) -> str:
    """Table key of a configuration: its transformer optimizations, in registry order, ``+``-joined (``""`` = stock)."""
    return "+".join(transformer_opts(tuple(opts)))


def launches(opts: list[str] | tuple[str, ...], table: dict[str, Any] | None = None) -> dict[str, int] | None:
    """``{"block": ..., "outside": ...}`` for this configuration, or None when the table does not hold it."""
    return (table or load_table())["entries"].get(key(opts))


def launches_per_call(opts: list[str] | tuple[str, ...], blocks: int = QWEN_IMAGE_BLOCKS) -> int | None:
    got = launches(opts)
    return None if got is None else blocks * got["block"] + got["outside"]


def saved_per_call(opts: list[str] | tuple[str, ...], blocks: int = QWEN_IMAGE_BLOCKS) -> int | None:
    """Launches per transformer call the configuration removes from stock's."""
    stock, mine = launches_per_call((), blocks), launches_per_call(opts, blocks)
    return None if stock is None or mine is None else stock - mine


@dataclass(frozen=True)
class Calibration:
    rope_saved_per_call: int
    modulation_saved_per_call: int
    us_rope: float
    us_modulation: float
    used: str

    @property
    def us_per_launch(self) -> float:
        return self.us_rope if self.used == "rope" else self.us_modulation

    def describe(self) -> str:
        r, s = REFERENCE, REFERENCE["steps"]
        return (
            f"{self.us_per_launch:.1f} us per launch, calibrated on the reference's NPU RoPE figure: "
            f"{r['rope_ms']:.0f} ms / ({s} steps x {self.rope_saved_per_call} launches per call) = "
            f"{self.us_rope:.1f} us (modulation sharing: {r['modulation_ms']:.0f} ms / ({s} x "
            f"{self.modulation_saved_per_call}) = {self.us_modulation:.1f} us, which also counts the weight reads it "
            "saves)"
        )


def calibration(blocks: int = QWEN_IMAGE_BLOCKS) -> Calibration:
    rope, mod = saved_per_call(("rope",), blocks), saved_per_call(("shared_modulation",), blocks)
    if not rope or not mod:
        raise ValueError(f"{TABLE_FILE.name} lacks the rope / shared_modulation entries the calibration needs")
    steps = REFERENCE["steps"] * REFERENCE["cfg_forwards"]
    return Calibration(
        rope, mod, REFERENCE["rope_ms"] * 1e3 / (steps * rope), REFERENCE["modulation_ms"] * 1e3 / (steps * mod), USED
    )


def ms_saved(
    opts: list[str] | tuple[str, ...], *, steps: int, cfg: bool = False, blocks: int = QWEN_IMAGE_BLOCKS
) -> float | None:
    """The estimate for one image: launches saved per call x steps x CFG forwards x us per launch (None: unknown)."""
    saved = saved_per_call(opts, blocks)
    if saved is None:
        return None
    return saved * steps * (2 if cfg else 1) * calibration(blocks).us_per_launch / 1e3


def summary(configs: dict[str, str], *, steps: int = REFERENCE["steps"], cfg: bool = False) -> str:
    """A benchmark's one-line estimate per configuration (name -> ``VLLM_OMNI_ASCEND_OPT`` spec); "n/a": unknown."""
    from vllm_omni_ascend_opt import flags

    parts = []
    for name, spec in configs.items():
        try:
            ms = ms_saved(flags.parse_spec(spec), steps=steps, cfg=cfg)
        except (OSError, ValueError, flags.FlagError):
            ms = None
        parts.append(f"{name} {'n/a' if ms is None else f'{ms:.0f}'}")
    return (
        f"{LABEL}, per image, 1280x704, {steps} steps, CFG {'on' if cfg else 'off'} "
        "(launch model: ablation/estimate.py, calibration in docs/results.md): " + ", ".join(parts)
    )
