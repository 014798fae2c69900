"""``vllm-omni-ascend-opt reference save`` and ``vllm-omni-ascend-opt compare`` (see :mod:`.refset` and
:mod:`.setcompare`; docs/ablation.md, "Comparing machines and releases").

Exit codes of ``compare``: 0 within the gates, 1 outside, 2 when nothing could be compared or on bad input.
``reference save``: 0, or 2 on bad input or a failed generation (nothing is left half-written).
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any

from vllm_omni_ascend_opt.ablation.cli import add_arguments, bad_input, make_plan, parse_gates
from vllm_omni_ascend_opt.ablation.workload import WorkloadError


def add_reference_commands(sub: Any) -> None:
    """Register ``reference save`` and ``compare`` on the main CLI's subparsers."""
    ref = sub.add_parser("reference", help="reference image sets to compare across machines and releases")
    rsub = ref.add_subparsers(dest="reference_cmd", metavar="ACTION", required=True)
    sv = rsub.add_parser(
        "save",
        help="generate a workload's prompts x seeds with one configuration and save them with a manifest",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    helps = {
        "--workload": "named workload or a .toml/.json file",
        "--model": "'tiny' (default), 'tiny-<variant>', a diffusers directory or a Hugging Face id",
        "--prompt": "a prompt (repeat for several)",
        "--image": "input image of an edit pipeline: a path or 'sample'",
    }
    flags = (
        "--workload --model --engine --dtype --height --width --steps --cfg-scale --prompt --prompts-file "
        "--negative-prompt --seeds --image --max-sequence-length --enforce-eager --threads --timeout --start-timeout "
        "--import"
    )
    add_arguments(sv, {"workload (as for ablate: a named workload's values, then these)": flags}, helps)
    sv.add_argument(
        "--config",
        default="none",
        help="the configuration: none (stock, default), default (the default-on optimizations that can act here), "
        "all, or a comma list of optimizations",
    )
    sv.add_argument("--out", type=Path, required=True, help="the set's directory (created; nothing else is written)")
    sv.add_argument("--tensors", action="store_true", help="also save the raw float outputs (.npy)")
    sv.add_argument("--fresh", action="store_true", help="replace a set already in --out")
    sv.set_defaults(func=cmd_reference_save, only=None, skip=None, order=None, quality_gates=None)

    cp = sub.add_parser(
        "compare",
        help="compare two reference sets (or a set and an ablation output) image by image",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    cp.add_argument("a", type=Path, help="a reference set or an ablation output directory")
    cp.add_argument("b", type=Path, help="a reference set or an ablation output directory")
    cp.add_argument("--config", help="the configuration of an ablation output to compare (default full)", default=None)
    cp.add_argument(
        "--tier",
        choices=("exact", "pixel", "close"),
        default="close",
        help="exact: bitwise tensors (pixel identity without tensors); pixel: identical uint8 images; close "
        "(default): the SSIM/PSNR gates",
    )
    cp.add_argument("--gates", metavar="ssim=0.99,psnr=35", help="the close gates (default ssim=0.99,psnr=35)")
    cp.add_argument("--out", type=Path, default=Path("compare-out"), help="report directory (default compare-out)")
    cp.set_defaults(func=cmd_compare)


def resolve_config(plan: Any, name: str) -> Any:
    """The :class:`~.plan.Config` of ``--config`` (``none``, ``default``, ``all`` or a comma list: see its help)."""
    from vllm_omni_ascend_opt.ablation.plan import Config, build_plan, opt_infos_from_registry

    infos = opt_infos_from_registry()
    if name == "none":
        return Config("reference", "none", (), "reference")
    p = build_plan(dataclasses.replace(plan.workload, stack="default" if name == "default" else "all"), infos)
    if name in ("default", "all"):
        return Config("reference", name, tuple(p.stack), "reference")
    names = [n.strip() for n in name.split(",") if n.strip()]
    bad = [n for n in names if n not in p.stack]
    if bad:
        why = "; ".join(f"{n}: {'; '.join(p.skipped.get(n, ['unknown optimization']))}" for n in bad)
        raise WorkloadError(f"--config {name}: {', '.join(bad)} cannot act here ({why})")
    opts = tuple(i.name for i in infos if i.name in names)  # registry order
    return Config("reference", ",".join(opts), opts, "reference")


def cmd_reference_save(args: argparse.Namespace, worker_cmd: list[str] | None = None) -> int:
    from vllm_omni_ascend_opt.ablation import refset

    try:
        refset.check_out_dir(args.out, args.fresh)
        plan = make_plan(args, build_model=True)
        config = resolve_config(plan, args.config)
    except (WorkloadError, refset.SetError) as exc:
        return bad_input(str(exc))
    wl = plan.workload
    print(
        f"reference set: {wl.model}, {wl.dtype}, {wl.width}x{wl.height}, {wl.steps} steps, CFG {wl.cfg_scale}, "
        f"{len(wl.prompts)} prompt(s) x seeds {wl.seeds}; configuration {config.label} ({config.spec}); "
        f"engine {plan.engine}",
        flush=True,
    )
    try:
        s = refset.save(
            plan, config, args.out, tensors=args.tensors, fresh=args.fresh, worker_cmd=worker_cmd, log=print
        )
    except refset.SetError as exc:
        return bad_input(str(exc))
    print(f"saved {len(s.entries)} image(s) and {refset.MANIFEST} to {args.out}")
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    from vllm_omni_ascend_opt.ablation import refset, setcompare

    try:
        gates = parse_gates(args.gates) if args.gates else {}
        a = refset.load(args.a, args.config)
        b = refset.load(args.b, args.config)
        res = setcompare.run_compare(a, b, tier=args.tier, **gates)  # unset gates: run_compare's defaults
    except (WorkloadError, refset.SetError) as exc:
        return bad_input(str(exc).replace("--quality-gates", "--gates"))
    paths = setcompare.write(res, a, b, args.out)
    print_summary(res)
    print("\nreport: " + "\n        ".join(str(p) for p in paths.values()))
    return int(res["exit_code"])


def print_summary(res: dict[str, Any]) -> None:
    """The side-by-side facts that differ, the pairs table and the verdict, as text."""
    from vllm_omni_ascend_opt.ablation.setcompare import HEAD, summary_rows

    print(f"A: {res['a']['path']} ({res['a']['kind']})\nB: {res['b']['path']} ({res['b']['kind']})")
    for f in res["facts"]:
        if not f["same"]:
            print(f"  {f['field']:<22} {f['a']!s:<30} {f['b']}")
    rows = summary_rows(res)
    if rows:
        widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(HEAD)]
        print("\n" + "  ".join(h.ljust(w) for h, w in zip(HEAD, widths, strict=True)))
        for r in rows:
            print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)))
    for side in ("a", "b"):
        for o in res[f"only_in_{side}"]:
            print(f"only in {side.upper()}: {o['id']}")
    print(f"\n{res['verdict']} (exit {res['exit_code']})")
