"""The shape of ``results.json`` (schema version 1), checked by :func:`validate` — documented in docs/ablation.md.

A spec is a type (or a tuple of types), a dict ``{key: spec}`` (every key required), ``[spec]`` (a list of such
items), or :class:`Opt` wrapping a spec that may also be ``None``. Non-finite floats are stored as the strings
``"inf"``/``"-inf"``/``"nan"`` (PSNR of identical images), so numeric fields accept :data:`NUM`.
"""

from __future__ import annotations

from typing import Any


class Opt:
    def __init__(self, spec: Any) -> None:
        self.spec = spec


NUM = (int, float, str)  # str only for "inf" / "-inf" / "nan"
STR = str

SAVED = {"mean": Opt(NUM), "std": Opt(NUM), "per_round": [NUM]}
#: A comparison's control: the stages nothing compared there changes, their difference and noise floor, and
#: whether that difference is process bias (docs/ablation.md, "How verdicts are made").
CONTROL = {"stages": [STR], "diff_ms": Opt(NUM), "per_round_ms": [NUM], "noise_ms": Opt(NUM), "bias": bool}
STAGED = {
    "stages": [STR],
    "noise_floor_ms": Opt(NUM),
    "total_saved_ms": SAVED,
    "total_saved_pct_of_stock": Opt(NUM),
    "control": Opt(CONTROL),
}
GATE = {"class": STR, "passed": Opt(bool), "why": STR}
METRICS = {
    "pixel_identical": bool,
    "bitwise_identical": Opt(bool),
    "max_abs_diff": NUM,
    "mean_abs_diff": NUM,
    "ssim": NUM,
    "psnr_db": NUM,
    "basis": STR,
}
CHECK = Opt({"reference": STR, "class": STR, "per_sample": dict, "worst": dict, "gate": GATE, "missing": [STR]})

RESULTS_SCHEMA: dict[str, Any] = {
    "schema_version": int,
    "tool": {"name": STR, "version": STR},
    "created": STR,
    "command": [STR],
    "verdict": {"result": STR, "exit_code": int, "reasons": [STR]},
    "workload": dict,
    "plan": {
        "workload": dict,
        "engine": STR,
        "schedule": STR,
        "model_path": Opt(STR),
        "stack": [STR],
        "skipped": dict,
        "optimizations": dict,
        "configs": [{"id": STR, "label": STR, "opts": [STR], "role": STR, "spec": STR}],
        "comparisons": [{"opt": STR, "with": STR, "without": STR}],
        "imports": [STR],
        "fingerprint": STR,
    },
    "environment": {
        "python": Opt(STR),
        "torch": Opt(STR),
        "torch_npu": Opt(STR),
        "vllm": Opt(STR),
        "vllm_omni": Opt(STR),
        "device": Opt(dict),
        "same_in_every_worker": bool,
        "workers": int,
    },
    "gates": {"ssim": NUM, "psnr_db": NUM, "min_improvement_pct": NUM},
    "measurement": {
        "round_stat": STR,
        "cpu_count": int,
        "load1_max": Opt(NUM),
        "load1_median": Opt(NUM),
        "others_cpu_median": Opt(NUM),
        "others_cpu_threshold": NUM,
        "wall_over_cpu_median": Opt(NUM),
        "busy": bool,
    },
    "noise_floor": Opt(
        {
            "ms": NUM,
            "mean_diff_ms": NUM,
            "se_ms": Opt(NUM),
            "pct": Opt(NUM),
            "per_round_ms": [NUM],
            "configs": [STR],
        }
    ),
    "full_vs_stock": Opt(
        {
            "saved_ms": SAVED,
            "saved_pct_of_stock": Opt(NUM),
            **STAGED,
            "stages_saved_ms": dict,
            "direction": STR,
            "label": STR,
            "stock_ms": Opt(NUM),
            "full_ms": Opt(NUM),
        }
    ),
    "optimizations": [
        {
            "name": STR,
            "equivalence": STR,
            "with": STR,
            "without": STR,
            "saved_ms": SAVED,
            "saved_pct_of_stock": Opt(NUM),
            **STAGED,
            "stages_saved_ms": dict,
            "direction": STR,
            "label": STR,
            "equivalence_check": CHECK,
        }
    ],
    "configs": [
        {
            "id": STR,
            "label": STR,
            "role": STR,
            "opts": [STR],
            "spec": STR,
            "status": STR,
            "error": Opt(STR),
            "rounds_complete": [int],
            "total_ms": SAVED,
            "stages_ms": dict,
            "load_s": [Opt(NUM)],
            "pids": [Opt(int)],
            "active_in_worker": Opt([STR]),
            "memory": Opt(dict),
            "outputs_stable_across_rounds": Opt(bool),
            "images": dict,
            "vs_stock": CHECK,
            "vs_full": CHECK,
        }
    ],
    "samples": [
        {
            "config": STR,
            "round": Opt(int),
            "prompt": int,
            "seed": int,
            "warmup": bool,
            "total_ms": NUM,
            "stages_ms": dict,
            "cpu_ms": Opt(NUM),
            "load1": Opt(NUM),
            "others_cpu": Opt(NUM),
            "sha256": Opt(STR),
            "pid": Opt(int),
        }
    ],
    "failures": [
        {
            "config": STR,
            "round": Opt(int),
            "phase": STR,
            "error": STR,
            "traceback": Opt(STR),
            "returncode": Opt(int),
            "log_tail": Opt(STR),
        }
    ],
    "run": {"wall_s": NUM, "resumed": bool, "dropped_on_resume": int, "interrupted": bool, "out_dir": STR},
}


def validate(obj: Any, spec: Any = None, path: str = "$") -> list[str]:
    """Every place where ``obj`` departs from ``spec`` (default :data:`RESULTS_SCHEMA`); empty when it conforms."""
    spec = RESULTS_SCHEMA if spec is None else spec
    if isinstance(spec, Opt):
        return [] if obj is None else validate(obj, spec.spec, path)
    if isinstance(spec, dict):
        if not isinstance(obj, dict):
            return [f"{path}: expected an object, got {type(obj).__name__}"]
        errs = []
        for k, sub in spec.items():
            if k not in obj:
                errs.append(f"{path}.{k}: missing")
            else:
                errs += validate(obj[k], sub, f"{path}.{k}")
        return errs
    if isinstance(spec, list):
        if not isinstance(obj, list):
            return [f"{path}: expected a list, got {type(obj).__name__}"]
        errs = []
        for i, item in enumerate(obj):
            errs += validate(item, spec[0], f"{path}[{i}]")
        return errs
    types = spec if isinstance(spec, tuple) else (spec,)
    if bool in types or not isinstance(obj, bool):
        if isinstance(obj, types):
            if isinstance(obj, str) and spec is NUM and obj not in ("inf", "-inf", "nan"):
                return [f"{path}: expected a number, got the string {obj!r}"]
            return []
    return [f"{path}: expected {'/'.join(t.__name__ for t in types)}, got {type(obj).__name__}"]
