"""From the command line to a workload and a plan: what ``ablate``, ``plan`` and ``reference save`` share."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import sys
from pathlib import Path
from typing import Any

from vllm_omni_ascend_opt.ablation.workload import (
    DTYPES,
    ENGINES,
    FIELDS,
    MODES,
    SCHEDULES,
    STACKS,
    Workload,
    WorkloadError,
    from_mapping,
    load_workload,
)


def bad_input(msg: str) -> int:
    """Print ``msg`` as the CLI's error line and return 2, every ablation command's exit code on bad input."""
    print(f"vllm-omni-ascend-opt: error: {msg}", file=sys.stderr)
    return 2


def parse_gates(text: str) -> dict[str, float]:
    """``ssim=0.99,psnr=35`` -> ``{"ssim_gate": 0.99, "psnr_gate": 35.0}``; raises WorkloadError on anything else."""
    out = {}
    for item in filter(str.strip, text.split(",")):
        key, _, val = item.partition("=")
        key = key.strip().lower()
        if key not in ("ssim", "psnr") or not val:
            raise WorkloadError(f"--quality-gates {text!r}: use ssim=<0..1>,psnr=<dB> (e.g. ssim=0.99,psnr=35)")
        try:
            out[f"{key}_gate"] = float(val)
        except ValueError:
            raise WorkloadError(f"--quality-gates {text!r}: {val!r} is not a number") from None
    return out


def _arguments() -> dict[str, dict[str, Any]]:
    """Every argument ``ablate``, ``plan`` and ``reference save`` can take: flag -> ``add_argument`` keywords."""
    ints = "--height --width --steps --warmup --repeats --max-sequence-length --process-sets --start-jobs --threads"
    table: dict[str, dict[str, Any]] = {f: {"type": int} for f in ints.split()}
    table.update({f: {"action": "append"} for f in ("--prompt", "--only", "--skip")})
    table.update({f: {} for f in ("--model", "--negative-prompt", "--image", "--order")})
    bools = ("--enforce-eager", "--pause-idle", "--vs-unquantized")
    table.update({f: {"action": argparse.BooleanOptionalAction, "default": None} for f in bools})
    choices = {"--engine": ENGINES, "--dtype": DTYPES, "--mode": MODES, "--stack": STACKS, "--schedule": SCHEDULES}
    table.update({f: {"choices": c} for f, c in choices.items()})
    return {
        **table,
        "--workload": {"metavar": "NAME"},
        "--cfg-scale": {"type": float},
        "--prompts-file": {"type": Path},
        "--seeds": {"type": int, "nargs": "+"},
        "--quality-gates": {"metavar": "ssim=0.99,psnr=35"},
        "--min-improvement-pct": {"type": float},
        "--import": {"dest": "imports", "action": "append", "default": [], "metavar": "MODULE"},
        "--timeout": {"type": float, "dest": "timeout_s"},
        "--start-timeout": {"type": float, "dest": "start_timeout_s"},
    }


def add_arguments(p: argparse.ArgumentParser, groups: dict[str, str], helps: dict[str, str]) -> Any:
    """Add to ``p`` a group per ``groups`` item (title -> flags) with their ``helps``; returns the last group."""
    table = _arguments()
    for title, flags in groups.items():
        g = p.add_argument_group(title)
        for f in flags.split():
            g.add_argument(f, **table[f], help=helps.get(f))
    return g


#: The workload behind the plain tiny flow (``ablate`` / ``plan`` without ``--workload``, model ``tiny``): the deeper
#: tiny model with steps, CFG and rounds whose saving clearly exceeds the noise (what ``make demo`` runs).
TINY_DEFAULT = "tiny-cpu"


def resolve_workload(args: argparse.Namespace) -> Workload:
    """The named workload (else :data:`TINY_DEFAULT` for the tiny model, else the defaults) with ``args`` over it."""
    plain_tiny = not args.workload and getattr(args, "model", None) in (None, "tiny")
    wl = load_workload(args.workload or TINY_DEFAULT) if args.workload or plain_tiny else Workload(name="custom")
    over: dict[str, Any] = {}
    for key in FIELDS:  # the options named as a workload field
        v = getattr(args, key, None)
        if v is not None and not (plain_tiny and key == "model"):  # tiny: the family, here its deeper model
            over[key] = v
    prompts = list(args.prompt or [])
    if args.prompts_file:
        try:
            lines = args.prompts_file.read_text(encoding="utf-8").splitlines()
        except OSError as exc:
            raise WorkloadError(f"--prompts-file: {exc}") from None
        prompts += [ln.strip() for ln in lines if ln.strip() and not ln.lstrip().startswith("#")]
        if not prompts:
            raise WorkloadError(f"--prompts-file {args.prompts_file}: no prompt in it")
    if prompts:
        over["prompts"] = prompts
    if args.quality_gates:
        over.update(parse_gates(args.quality_gates))
    if over and (args.workload or plain_tiny):
        wl = dataclasses.replace(wl, name=f"{wl.name} (modified)")
    return from_mapping(over, name=wl.name, base=wl).validate()


def make_plan(args: argparse.Namespace, *, build_model: bool) -> Any:
    from vllm_omni_ascend_opt import registry
    from vllm_omni_ascend_opt.ablation.plan import build_plan, opt_infos_from_registry

    wl = resolve_workload(args)
    registry.all_optimizations()  # built-ins first: --import modules add to the registry
    for m in args.imports:
        try:
            importlib.import_module(m)
        except Exception as exc:  # bad input
            raise WorkloadError(f"--import {m}: {type(exc).__name__}: {exc}") from None
    plan = build_plan(
        wl,
        opt_infos_from_registry(),
        only=args.only,
        skip=args.skip,
        order=[args.order] if args.order else None,
        extra_imports=args.imports,
    )
    if wl.is_tiny and build_model:
        from vllm_omni_ascend_opt.testbed import build_model_dir

        plan.model_path = str(build_model_dir(wl.tiny_spec()))
    elif not wl.is_tiny:
        p = Path(wl.model).expanduser()
        if p.is_dir():
            if not (p / "model_index.json").is_file():
                raise WorkloadError(f"--model {wl.model}: {p} has no model_index.json (not a diffusers directory)")
            plan.model_path = str(p.resolve())
        elif len(parts := wl.model.split("/")) != 2 or not all(parts) or wl.model.startswith((".", "/", "~")):
            raise WorkloadError(f"--model {wl.model!r}: no such directory, and not a Hugging Face id (org/name)")
    return plan
