"""Command line: ``vllm-omni-ascend-opt list [--json]``, ``warmup --sizes ...`` and the lab's ablation commands (the
top layer of the package: it may import the lab, which the plugin core never does)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
import textwrap
from pathlib import Path
from typing import Any

from vllm_omni_ascend_opt import _plugin, _report, api, flags
from vllm_omni_ascend_opt._parallel import why_off
from vllm_omni_ascend_opt._state import STATE
from vllm_omni_ascend_opt._version import __version__


def _cmd_list(args: argparse.Namespace) -> int:
    _plugin.register()  # reads VLLM_OMNI_ASCEND_OPT exactly as a vLLM-Omni process would
    rows, omni, vllm = api.status(), _plugin.installed_version("vllm-omni"), _plugin.installed_version("vllm")
    if args.json:
        out = {"version": __version__, "flag": {flags.ENV_FLAG: flags.spec_from_env()}, "vllm_omni": omni}
        out |= {"vllm": vllm, "optimizations": rows, "mode_notes": _report.mode_notes()}
        print(json.dumps(out, indent=2))
        return 0
    print(f"vllm-omni-ascend-opt {__version__}  ({flags.ENV_FLAG}={flags.spec_from_env()!r})")
    print(f"vllm-omni {omni or 'not installed'}, vllm {vllm or 'not installed'}")
    if STATE.config_error:
        print(f"\nERROR: {STATE.config_error}\nNothing is patched.")
    if STATE.version_error:
        forced = flags.force_from_env()
        print(f"\nWARNING: {STATE.version_error}. {'Patching anyway (FORCE).' if forced else 'Nothing is patched.'}")
    if STATE.version_note:
        print(f"\nnote: {STATE.version_note}")
    print()
    hdr = f"{'optimization':<18} {'tier':<6} {'default':<8} {'state':<9} flag"
    print(hdr, "-" * len(hdr), sep="\n")
    for r in rows:
        state = "active" if r["active"] else "inactive"
        print(
            f"{r['name']:<18} {r['tier']:<6} {'on' if r['default'] else 'off':<8} {state:<9} "
            f"{r['flag']['enable']} / {r['flag']['disable']}"
        )
        for why in r["reasons_inactive"]:
            print(textwrap.fill(why, 110, initial_indent="    why: ", subsequent_indent="         "))
        for note in r["notes"]:
            print(textwrap.fill(note, 110, initial_indent="    note: ", subsequent_indent="          "))
        modes = [f"{m}={'yes' if v == 'supported' else 'no'}" for m, v in r["parallel_support"].items()]
        print("    parallel: " + ", ".join(modes))
        for m, v in r["parallel_support"].items():
            if (why := why_off(v)) is not None:
                print(textwrap.fill(f"{m}: {why}", 110, initial_indent="    off in ", subsequent_indent="          "))
    print("\nvLLM-Omni modes:")
    for note in _report.mode_notes():
        print(textwrap.fill(note, 110, initial_indent="  - ", subsequent_indent="    "))
    return 1 if STATE.config_error else 0


def _cmd_warmup(args: argparse.Namespace) -> int:
    from vllm_omni_ascend_opt import _backend, warmup

    try:
        sizes = warmup.parse_sizes(args.sizes)
        batches = warmup.parse_ints(args.batch, "--batch")
        texts = warmup.parse_ints(args.text, "--text") if args.text else list(warmup.DEFAULT_TEXT)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if _backend.torch_npu_module() is None:
        why = "; ".join(_backend.npu_unavailable_reasons())
        print(f"warmup: nothing to verify here ({why}): the kernels are checked on an Ascend NPU only")
        return 1
    rows = warmup.warm(sizes, batches, args.sp, texts)
    if args.json:
        print(json.dumps({"rows": [dataclasses.asdict(r) for r in rows], "summary": warmup.summary(rows)}, indent=1))
        return 0
    print(*(r.text() for r in rows), warmup.summary(rows), sep="\n")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="vllm-omni-ascend-opt",
        description="Ascend NPU optimizations for vLLM-Omni Qwen-Image: inspect them and measure what each is worth.",
    )
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    p.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = p.add_subparsers(dest="cmd", required=True)
    lp = sub.add_parser("list", help="every optimization with its class, default, state here and flag spelling")
    lp.add_argument("--json", action="store_true", help="machine-readable output")
    lp.set_defaults(func=_cmd_list)
    wp = sub.add_parser(
        "warmup",
        help="verify the kernel shape classes of these image sizes now and save the verdicts (a server starts warm)",
    )
    wp.add_argument("--sizes", required=True, help="WIDTHxHEIGHT list, e.g. 1328x1328,1664x928")
    wp.add_argument("--batch", default="1", help="batch sizes, e.g. 1,2 (2: CFG batched); default 1")
    wp.add_argument("--sp", type=int, default=1, help="sequence-parallel (Ulysses) degree; default 1")
    wp.add_argument("--text", help="prompt token counts to cover (bucketed); default 64,128,256,512")
    wp.add_argument("--json", action="store_true", help="machine-readable output (with each class's timings)")
    wp.set_defaults(func=_cmd_warmup)
    try:
        from vllm_omni_ascend_opt.ablation import cli as ablation_cli
        from vllm_omni_ascend_opt.ablation import refcli
    except ImportError:  # the lab's own dependencies are missing: list and warmup only
        return p
    ablation_cli.add_subcommands(sub)
    refcli.add_reference_commands(sub)
    pl = sub.choices["plan"]
    pl.add_argument("--measured", metavar="FILE", help="saved kernel timings to set beside the device-time model "
                    "(default: this device's saved verdicts, when they hold timings)")  # fmt: skip
    pl.set_defaults(func=_with_measured(pl.get_default("func")))
    return p


def _with_measured(plan: Any) -> Any:
    """``plan``, then the measured kernel timings beside the model (``devtime/measured.py``) where there are some."""

    def run(args: argparse.Namespace) -> int:
        from vllm_omni_ascend_opt.blocks.kernels import saved
        from vllm_omni_ascend_opt.devtime import measured

        rc = plan(args)
        path = args.measured or saved.path()
        if rc == 0 and not args.json and path is not None and Path(path).is_file():
            hw = {k: getattr(args, k) for k in ("height", "width", "steps") if getattr(args, k, None)}
            print("\n".join(measured.section(Path(path), **hw)))
        return rc

    return run


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(message)s")
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
