"""``vllm-omni-ascend-opt ablate`` and ``vllm-omni-ascend-opt plan`` (a dry run of ``ablate``); ``reference save``
and ``compare`` are in :mod:`.refcli`.

Exit codes of ``ablate``: 0 PASS, 1 FAIL, 2 INCONCLUSIVE or bad input (see :mod:`.verdict`). ``plan`` exits 0, or 2 on
bad input.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import sys
import textwrap
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
    available_workloads,
    from_mapping,
    load_workload,
)

DEFAULT_OUT = "ablation-out"


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


def _add_common(p: argparse.ArgumentParser) -> None:
    helps = {
        "--workload": f"named workload ({', '.join(available_workloads())}) or a .toml/.json file; looked up as a "
        "path, in ./ablations/, then in the package",
        "--model": "'tiny' (the embedded test-bed Qwen-Image, default; without --workload the values of the "
        f"'{TINY_DEFAULT}' workload: its 12-block model, steps, CFG and rounds), 'tiny-<variant>', a diffusers "
        "directory, or a Hugging Face id of a Qwen-Image checkpoint",
        "--engine": "testbed: vLLM-Omni's pipeline in the worker; omni: vLLM-Omni's offline engine Omni (accelerator "
        "only); auto: testbed for tiny, omni for a real checkpoint when an accelerator is visible",
        "--steps": "denoising steps",
        "--cfg-scale": "true CFG scale (1 = off)",
        "--prompt": "a prompt (repeat for several)",
        "--prompts-file": "one prompt per line ('#' starts a comment)",
        "--seeds": "seeds (default 42 43 44)",
        "--warmup": "warm-up generations per worker process (default 2)",
        "--repeats": "rounds; each runs every configuration on every seed (default 2)",
        "--enforce-eager": "Omni engine: disable torch.compile / graphs (default: on)",
        "--mode": "leave-one-out (default): full, full minus each, stock; "
        "cumulative: stock, +1st, +1st+2nd, ...; single: stock + each alone",
        "--order": "comma list: order of the cumulative mode (default: registry order)",
        "--only": "comma list: only these optimizations take part",
        "--skip": "comma list: these optimizations do not take part",
        "--stack": "default: the full stack is the default-on optimizations; all: every active one",
        "--quality-gates": "gates of 'close' optimizations",
        "--min-improvement-pct": "PASS needs the full stack to save at least this %% of stock (default 1)",
        "--vs-unquantized": "also run stock without od_config's quantization_config (vLLM-Omni's int8) and report "
        "the quantized stock against it (time, SSIM/PSNR) as information, outside the verdict",
        "--import": "import MODULE in the runner and every worker before the plugin loads (out-of-tree optimizations)",
        "--schedule": "resident: one live worker per configuration, interleaved request by request; per-round: a "
        "fresh process per configuration and round, one at a time (auto: resident for tiny, per-round otherwise)",
        "--process-sets": "resident: split the rounds into this many blocks of freshly started workers (default 1)",
        "--pause-idle": "resident: SIGSTOP every worker (and the engine processes it started) outside its own turn",
        "--start-jobs": "workers starting at the same time (resident; default 2)",
        "--threads": "torch threads per worker (default: torch's choice)",
        "--timeout": "seconds allowed per generation (default 600)",
        "--start-timeout": "seconds allowed for a worker to import, load and report ready (default 1800)",
    }
    groups = {
        "workload (a named workload's values, then these, override the defaults)": "--workload --model --engine "
        "--dtype --height --width --steps --cfg-scale --prompt --prompts-file --negative-prompt --seeds --warmup "
        "--repeats --max-sequence-length --enforce-eager",
        "ablation": "--mode --order --only --skip --stack --quality-gates --min-improvement-pct --vs-unquantized "
        "--import",
        "execution": "--schedule --process-sets --pause-idle --start-jobs --threads --timeout --start-timeout",
    }
    add_arguments(p, groups, helps).add_argument(
        "--out",
        type=Path,
        default=Path(DEFAULT_OUT),
        help=f"output directory (default {DEFAULT_OUT}); nothing is written outside it",
    )


def add_subcommands(sub: Any) -> None:
    """Register ``ablate`` and ``plan`` on the main CLI's subparsers."""
    ab = sub.add_parser(
        "ablate",
        help="measure what each optimization is worth (leave-one-out, cumulative, single)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_common(ab)
    ab.add_argument("--fresh", action="store_true", help="discard earlier results in --out and start over")
    ab.add_argument("--no-progress", action="store_true", help="no progress bar")
    ab.add_argument(
        "--reference", type=Path, metavar="DIR", help="a reference set (reference save) to compare every image with"
    )
    ab.set_defaults(func=cmd_ablate)
    pl = sub.add_parser(
        "plan",
        help="dry run of ablate: configurations, number of runs, estimated duration; for a Qwen-Image NPU workload "
        "also the device-time model's predictions (a model, not measured)",
    )
    _add_common(pl)
    pl.add_argument("--json", action="store_true", help="machine-readable output")
    pl.add_argument(
        "--cards", default="", help="also the device-time model's multi-card layouts for one image, e.g. on 2,4,8 cards"
    )
    pl.add_argument(
        "--quantization",
        choices=("int8",),
        help="also the device-time model's predictions under vLLM-Omni's NPU int8 (default: the workload's "
        "od_config quantization_config)",
    )
    pl.set_defaults(func=cmd_plan)


def _print_plan(plan: Any, est: Any | None = None) -> None:
    wl = plan.workload
    print(f"ablation '{wl.name}': mode {wl.mode}, engine {plan.engine}, schedule {plan.schedule}")
    print(
        f"  model {wl.model}, {wl.dtype}, {wl.width}x{wl.height}, {wl.steps} steps, CFG {wl.cfg_scale}, "
        f"{len(wl.prompts)} prompt(s) x seeds {wl.seeds}, warm-up {wl.warmup}, repeats {wl.repeats}"
    )
    print(f"  full stack: {', '.join(plan.stack) or '(empty)'}")
    print(f"\n  {'configuration':<24} {'role':<14} VLLM_OMNI_ASCEND_OPT")
    for c in plan.configs:
        drop = f" (od_config without {', '.join(c.od_drop)}: information, no verdict)" if c.od_drop else ""
        print(f"  {c.id:<24} {c.role:<14} {c.spec}{drop}")
    close = [n for n in plan.stack if plan.opts[n].equivalence == "close"]
    if close:
        print("\n  close-tier gates (each vs the configuration without it; several at once: the loosest of theirs):")
        for n in close:
            g = plan.close_gates([n])
            own = "own" if plan.opts[n].close_gates else "workload's"
            print(f"    {n:<18} SSIM >= {g['ssim']}, PSNR >= {g['psnr_db']} dB ({own})")
    if plan.comparisons:
        on = {c.opt: "+".join(plan.stages_of(plan.diff(c.with_, c.without))) for c in plan.comparisons}
        print(
            "\n  verdicts from: "
            + "; ".join(f"{c.opt} = {c.without} - {c.with_} (on {on[c.opt]})" for c in plan.comparisons)
        )
    if plan.skipped:
        print("\n  not in this run:")
        for n, why in plan.skipped.items():
            print(textwrap.fill("; ".join(why), 110, initial_indent=f"    {n:<18} ", subsequent_indent=" " * 23))
    for note in plan.notes:
        print(textwrap.fill(note, 110, initial_indent="\n  note: ", subsequent_indent="        "))
    if est is not None:
        print(
            f"\n  {len(plan.configs)} configurations, {est.processes} worker processes, {est.generations} "
            f"generations ({est.measured} measured); estimated {est.seconds / 60:.1f} min ({est.assumptions})"
        )


def cmd_plan(args: argparse.Namespace) -> int:
    from vllm_omni_ascend_opt.ablation.plan import estimate
    from vllm_omni_ascend_opt.warmup import parse_ints

    try:
        plan = make_plan(args, build_model=False)
        cards = parse_ints(args.cards, "--cards") if args.cards.strip() else []
    except ValueError as exc:  # WorkloadError included
        return bad_input(str(exc))
    est = estimate(plan)
    stored = _stored_measurements(plan, args.out)
    wl = plan.workload
    devtime = None
    if not wl.is_tiny:  # the device-time model is of a real checkpoint
        from vllm_omni_ascend_opt.devtime import report as devtime_report

        devtime = devtime_report.for_plan(
            # the unquantized information configuration is bf16 stock: the bf16 column already prices it
            {c.id: list(c.opts) for c in plan.configs if not c.od_drop},
            model=wl.model,
            height=wl.height,
            width=wl.width,
            steps=wl.steps,
            cfg_forwards=2 if wl.cfg_scale > 1 else 1,
            cards=cards,
            quantization=args.quantization or wl.od_config.get("quantization_config"),
        )
    if args.json:
        out = {"plan": plan.to_dict(), "estimate": dataclasses.asdict(est), "stored_measurements": stored}
        if devtime is not None:
            out["devtime_model"] = {k: v for k, v in devtime.items() if k not in ("tables", "layouts")}
        print(json.dumps(out, indent=1))
        return 0
    _print_plan(plan, est)
    if devtime is not None:
        print("\n".join(devtime_report.plan_lines(devtime)))
    if stored:
        print(
            f"\n  {args.out} already holds {stored} measurement(s) of this plan: ablate would resume (--fresh: "
            "start over)"
        )
    if not plan.stack:
        print("\n  nothing to measure: no optimization can take part (see above)")
    return 0


def _stored_measurements(plan: Any, out: Path) -> int:
    from vllm_omni_ascend_opt.ablation.runner import OutDir, Store, select_resumable

    od = OutDir(out)
    if od.stored_fingerprint() != plan.fingerprint():
        return 0
    kept, _ = select_resumable(plan, Store(od.log, plan.fingerprint()).load())
    return sum(1 for r in kept if r.get("type") == "sample" and not r.get("warmup"))


def cmd_ablate(args: argparse.Namespace) -> int:
    from vllm_omni_ascend_opt.ablation import refset, report, setcompare, verdict
    from vllm_omni_ascend_opt.ablation.runner import RunError, Runner

    try:
        plan = make_plan(args, build_model=True)
        if args.reference:
            refset.load(args.reference)  # checked before anything runs
    except (WorkloadError, refset.SetError) as exc:
        return bad_input(str(exc))
    _print_plan(plan)
    if not plan.stack:
        return bad_input("nothing to measure: no optimization can take part in this run (reasons above)")
    print(flush=True)
    try:
        data = Runner(plan, args.out, fresh=args.fresh, progress=not args.no_progress).run()
    except RunError as exc:
        return bad_input(str(exc))
    analysis = verdict.analyse(plan, data.records, data.out.root, interrupted=data.interrupted)
    results = report.build_results(data, analysis, command=["vllm-omni-ascend-opt", *sys.argv[1:]])
    if args.reference:
        results["reference"] = setcompare.against_reference(args.reference, data.out.root, plan, results["environment"])
    paths = report.write_all(results, args.out)
    print_summary(results)
    print(f"\nreport: {paths['markdown']}\n        {paths['json']}\n        {paths['chart']}")
    return int(results["verdict"]["exit_code"])


def print_summary(results: dict[str, Any]) -> None:
    """The main table of report.md, as text."""
    from vllm_omni_ascend_opt.ablation.compare import fmt_db
    from vllm_omni_ascend_opt.ablation.report import _num, _on, _saved, comparison_rows, gate_cell

    print(
        f"\n{'optimization':<22} {'class':<6} {'on stages':<20} {'saved ms (mean ± std)':>22} {'% stock':>8}  "
        f"{'total saved ms':>16}  {'direction':<10} {'label':<13} {'p':>8} equivalence"
    )
    for name, cls, d, chk in comparison_rows(results):
        total = _num((d.get("total_saved_ms") or {}).get("mean"), "+.2f")
        print(
            f"{name:<22} {cls:<6} {_on(d):<20} {_saved(d):>22} {_num(d['saved_pct_of_stock'], '+.2f', '%'):>8}  {total:>16}  "
            f"{d['direction']:<10} {d['label']:<13} {_num(d.get('p_value'), '.2g'):>8} "
            f"{gate_cell(chk).replace('✅', 'ok').replace('❌', 'FAIL')}"
        )
    nf = results["noise_floor"]
    print(f"noise floor: {nf['ms']:.2f} ms" if nf else "noise floor: unknown")
    sig = results.get("significance")
    if sig:
        print(
            f"p: {sig['test']}, {sig['correction']}-corrected over the optimizations, family-wise level "
            f"{100 * sig['family_wise_level']:g}%" + ("" if sig["tested"] else " (too few rounds: not applied)")
        )
    for c in results["configs"]:
        if c["status"] != "ok":
            print(f"configuration {c['id']}: {c['status']}" + (f" ({c['error']})" if c["error"] else ""))
    if info := (results.get("information") or {}).get("vs_unquantized"):
        line = f"information (not in the verdict): {info['quantization']} {info['config']} vs {info['reference']}: "
        if info["status"] != "ok":
            line += info["status"]
        else:
            t, w = info["time"], info["image"]["worst"]
            pct = "" if t["saved_pct_of_unquantized"] is None else f" ({t['saved_pct_of_unquantized']:+.2f}%)"
            img = "images missing: " + ", ".join(info["image"]["missing"])
            if w:
                img = f"SSIM min {w['ssim_min']:.4f}, PSNR min {fmt_db(w['psnr_db_min'])}"
            line += f"saves {_saved(t)} ms{pct}, p = {t['p_value']:.2g}, {t['label']}; {img}"
        print(textwrap.fill(line, 110, subsequent_indent="  "))
    v = results["verdict"]
    print(f"\nverdict: {v['result']} (exit {v['exit_code']})")
    for r in v["reasons"]:
        print(textwrap.fill(r, 110, initial_indent="  - ", subsequent_indent="    "))
