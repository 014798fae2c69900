"""The shape of ``results.json`` (schema version 1), checked by :func:`validate` — documented in docs/ablation.md.

A spec is a type (or a tuple of types), a dict ``{key: spec}`` (every key required), ``[spec]`` (a list of such
items), or :class:`Opt` wrapping a spec that may also be ``None``; :func:`fields` writes a flat dict spec as text.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class Opt:
    spec: Any


NUM = (int, float, str)  # str only for "inf" / "-inf" / "nan": non-finite floats (PSNR of identical images)
#: The letters of :func:`fields`: str, number, int, bool, dict, and lists of str / number / int.
TYPES: dict[str, Any] = {"s": str, "n": NUM, "i": int, "b": bool, "d": dict, "S": [str], "N": [NUM], "I": [int]}


def fields(text: str) -> dict[str, Any]:
    """``"name:s round:i? ..."`` -> ``{"name": str, "round": Opt(int), ...}`` (letters: :data:`TYPES`; ``?``: or None)."""
    out = {}
    for item in text.split():
        key, _, t = item.partition(":")
        out[key] = Opt(TYPES[t[:-1]]) if t.endswith("?") else TYPES[t]
    return out


SAVED = fields("mean:n? std:n? per_round:N")
#: A comparison's control: the stages nothing compared there changes, their difference and noise floor, and
#: whether that difference is process bias (docs/ablation.md, "How verdicts are made").
CONTROL = fields("stages:S diff_ms:n? per_round_ms:N noise_ms:n? bias:b")
#: A comparison's saving on its stages, beside the total (:func:`.stats.staged_fields`).
STAGED = {
    "saved_ms": SAVED,
    **fields("saved_pct_of_stock:n? stages:S noise_floor_ms:n?"),
    "total_saved_ms": SAVED,
    **fields("total_saved_pct_of_stock:n? stages_saved_ms:d direction:s label:s p_value:n? p_raw:n?"),
    "control": Opt(CONTROL),
}
CHECK = Opt({**fields("reference:s class:s per_sample:d worst:d missing:S"), "gate": fields("class:s passed:b? why:s")})
#: ``information.vs_unquantized``: the quantized stock against stock without the quantization, never judged.
VS_UNQUANTIZED = {
    **fields("reference:s config:s quantization:s in_verdict:b status:s"),
    "time": Opt(
        {
            "saved_ms": SAVED,
            **fields(
                "stages:S se_ms:n? saved_pct_of_unquantized:n? stages_saved_ms:d unquantized_ms:n quantized_ms:n "
                "noise_floor_ms:n? direction:s p_value:n tested:b label:s"
            ),
        }
    ),
    "image": Opt(fields("per_sample:d worst:d missing:S")),
}

RESULTS_SCHEMA: dict[str, Any] = {
    **fields("schema_version:i"),
    "tool": fields("name:s version:s"),
    **fields("created:s command:S"),
    "verdict": fields("result:s exit_code:i reasons:S"),
    "significance": fields("test:s family_wise_level:n correction:s family:i tested:b"),
    "workload": dict,
    "plan": {
        **fields("workload:d engine:s schedule:s model_path:s? stack:S skipped:d optimizations:d"),
        "configs": [fields("id:s label:s opts:S role:s spec:s")],
        "comparisons": [fields("opt:s with:s without:s")],
        **fields("imports:S fingerprint:s"),
    },
    "environment": fields(
        "python:s? torch:s? torch_npu:s? vllm:s? vllm_omni:s? device:d? same_in_every_worker:b workers:i"
    ),
    "gates": fields("ssim:n psnr_db:n min_improvement_pct:n"),
    "measurement": fields(
        "round_stat:s cpu_count:i load1_max:n? load1_median:n? others_cpu_median:n? others_cpu_threshold:n "
        "wall_over_cpu_median:n? busy:b"
    ),
    "noise_floor": Opt(fields("ms:n mean_diff_ms:n se_ms:n? pct:n? per_round_ms:N configs:S")),
    "full_vs_stock": Opt({**STAGED, **fields("stock_ms:n? full_ms:n?")}),
    "optimizations": [{**fields("name:s equivalence:s with:s without:s"), **STAGED, "equivalence_check": CHECK}],
    "configs": [
        {
            **fields("id:s label:s role:s opts:S spec:s status:s error:s? rounds_complete:I"),
            "total_ms": SAVED,
            **fields("stages_ms:d active_in_worker:S? memory:d? outputs_stable_across_rounds:b? images:d"),
            "load_s": [Opt(NUM)],
            "pids": [Opt(int)],
            "vs_stock": CHECK,
            "vs_full": CHECK,
        }
    ],
    "information": Opt({"vs_unquantized": Opt(VS_UNQUANTIZED)}),
    "samples": [
        fields(
            "config:s round:i? prompt:i seed:i warmup:b total_ms:n stages_ms:d cpu_ms:n? load1:n? others_cpu:n? "
            "sha256:s? pid:i?"
        )
    ],
    "failures": [fields("config:s round:i? phase:s error:s traceback:s? returncode:i? log_tail:s?")],
    "run": fields("wall_s:n resumed:b dropped_on_resume:i interrupted:b out_dir:s"),
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
        return [e for i, item in enumerate(obj) for e in validate(item, spec[0], f"{path}[{i}]")]
    types = spec if isinstance(spec, tuple) else (spec,)
    if bool in types or not isinstance(obj, bool):
        if isinstance(obj, types):
            if isinstance(obj, str) and spec is NUM and obj not in ("inf", "-inf", "nan"):
                return [f"{path}: expected a number, got the string {obj!r}"]
            return []
    return [f"{path}: expected {'/'.join(t.__name__ for t in types)}, got {type(obj).__name__}"]
