#!/usr/bin/env python
"""Host time per transformer forward where compute is negligible: what the plugin's own Python costs, in ONE run.

Usage (from the repo root)::

    .venv/bin/python benchmarks/bench_host.py                    # stock, default, all, each optimization
    .venv/bin/python benchmarks/bench_host.py --quick            # fewer rounds
    .venv/bin/python benchmarks/bench_host.py --depth deep       # 12 blocks (the tiny CPU workloads' model)
    .venv/bin/python benchmarks/bench_host.py --profile default  # also the cProfile top items of that config
    .venv/bin/python benchmarks/bench_host.py --json out.json
    .venv/bin/python benchmarks/bench_host.py --compiled regional,full   # compiled default vs stock, real width
    .venv/bin/python benchmarks/bench_host.py --instructions     # instructions per forward (valgrind)
    .venv/bin/python benchmarks/bench_host.py --split            # host time per segment: outside / each block

Why: on an Ascend NPU, batch-1 eager Qwen-Image is host-bound (each kernel launch costs host time and the device
waits on it). The plugin removes launches; this benchmark checks that its own Python (memo lookups, guards, module
calls) does not eat what the removed launches save. It builds vLLM-Omni's real
``QwenImageTransformer2DModel`` at the TINY test-bed width (2 blocks, hidden 64; ``--depth deep``: 12 blocks, the
tiny CPU workloads' model, where the per-forward work outside the blocks weighs less, as in a 60-block real model) in
fp32, on 1 thread, with a small image (64x64: 16 image + 32 text tokens), where the kernels' compute is negligible next to their dispatch, so the
time per forward is the host time: Python + dispatch per op.

Measured per configuration (stock, default, all, and each transformer optimization alone; those with ``needs``
together with what they need), interleaved round-robin (``--rounds`` rounds of one cold forward after switching,
then ``--warm`` timed warm forwards each, under ``inference_mode`` like vLLM-Omni's runner):

* host time per warm forward: median and spread (interquartile range / median) over all warm forwards;
* ratio to stock in this run (median / stock's median), and the spread of the per-round ratios (min-max);
* kernel-launching ops per block and per forward (``testbed/opcount.OpCounter``, under ``no_grad``, the project's
  convention: stock's tiny block counts 106) and host time per op (forward time / ops per forward);
* host synchronisation points per forward (``testbed/opcount.SyncCounter``: ``item``, ``tolist``, ``.cpu()``,
  ``numpy``, tensor truthiness, ``_local_scalar_dense``, ``torch.equal``) with where each one is. A denoise step is
  one forward without CFG and two with it (vLLM-Omni's Qwen-Image pipeline runs the two branches one after the other).

The kernels' arithmetic is small here, not nil: MKL's small GEMMs, the GELU's ``tanh`` and the attention kernel
cost about the same per call at any of these token counts, and run on the timed thread (on an NPU they run on the
device). ``--instructions`` counts instructions per forward under callgrind and splits off that arithmetic
(``benchmarks/instructions.py``): exact, and not disturbed by other processes on a shared machine.

Speed claims belong here, never in a timed unit test. The CPU's per-op dispatch cost (the ``us/op`` column) is of the
order of an NPU launch's host cost (benchmarks/README.md), so these ratios are a proxy of the NPU's host-bound ratio,
not the NPU claim.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import importlib
import io
import json
import os
import platform
import pstats
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

IMAGE = 64


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=9, help="round-robin rounds")
    p.add_argument("--warm", type=int, default=30, help="timed warm forwards per config per round")
    p.add_argument("--quick", action="store_true", help="4 rounds x 15 warm forwards")
    p.add_argument(
        "--depth",
        choices=("tiny", "deep"),
        default="tiny",
        help="tiny: 2 blocks (the unit tests' model, the issue's table); deep: 12 blocks (the tiny CPU workloads' "
        "model): closer to a real model's share of per-block work (60 blocks)",
    )
    p.add_argument(
        "--configs",
        default="",
        help="comma list of config names (default: all of them; --instructions: stock, default, all)",
    )
    p.add_argument("--profile", default="", help="comma list of configs to profile (cProfile, top items)")
    p.add_argument("--profile-top", type=int, default=15)
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    p.add_argument(
        "--compiled",
        default="",
        help="instead: compiled default vs compiled stock at REAL width, per granularity (comma list of "
        "'regional', 'full'), each configuration in its own process, interleaved rounds",
    )
    p.add_argument("--compiled-size", type=int, default=128, help="image side for --compiled (real width)")
    p.add_argument(
        "--instructions",
        action="store_true",
        help="instead: instructions per forward under valgrind's callgrind (exact, not disturbed by other processes), "
        "split into kernel arithmetic and host work (benchmarks/instructions.py)",
    )
    p.add_argument("--instr-forwards", type=int, default=10, help="forwards counted per configuration")
    p.add_argument(
        "--split",
        action="store_true",
        help="instead: host time per segment of the forward (before the first block, the first block, a later "
        "block, after the last), measured inside each forward (benchmarks/segments.py); stock, default, all",
    )
    p.add_argument("--child", default="", help=argparse.SUPPRESS)  # "spec|granularity|size": a --compiled worker
    p.add_argument("--child-instr", default="", help=argparse.SUPPRESS)  # "flags|depth|n": an --instructions child
    return p.parse_args(argv)


#: Host-only mechanisms that can be left out of the default stack for a leave-it-out in the same run
#: (``--configs default,default-direct_calls``): config suffix -> (module, attribute, what replaces it).
LEAVE_OUT: dict[str, tuple[str, str, Callable[[], Any]]] = {
    "direct_calls": (
        "vllm_omni_ascend_opt.blocks.body.direct_calls",
        "decided",
        lambda: lambda: "left out by bench_host",
    ),
}


@contextlib.contextmanager
def left_out(name: str) -> Any:
    """While the config ``name`` runs: ``default-<mechanism>`` has that host-only mechanism switched off."""
    mechanism = name.split("-", 1)[1] if name.startswith("default-") else None
    if mechanism not in LEAVE_OUT:
        yield
        return
    module, attr, make = LEAVE_OUT[mechanism]
    mod = importlib.import_module(module)
    kept = getattr(mod, attr)
    setattr(mod, attr, make())
    try:
        yield
    finally:
        setattr(mod, attr, kept)


def configurations() -> tuple[dict[str, str], dict[str, str]]:
    """(name -> flags, skipped name -> why): stock, default, all, then each optimization that changes the
    transformer, alone (with the optimizations it needs), when it can act in this process."""
    from vllm_omni_ascend_opt import registry

    configs = {"stock": "none", "default": "default", "all": "all"}
    skipped: dict[str, str] = {}
    for opt in registry.all_optimizations():
        if not opt.regions & {"block", "transformer"}:
            skipped[opt.name] = f"acts outside the transformer ({', '.join(sorted(opt.regions))})"
            continue
        why = opt.reasons_inactive()
        if why:
            skipped[opt.name] = "; ".join(why)
            continue
        configs[opt.name] = ",".join(["none", *(f"+{n}" for n in (*opt.needs, opt.name))])
    configs.update({f"default-{m}": "default" for m in LEAVE_OUT})
    return configs, skipped


def forward_s(tr: Any, rt: Any, kw: dict[str, Any]) -> tuple[float, float]:
    """(host thread CPU seconds, wall seconds) of one forward. The thread's CPU time is the host time proper: it
    does not count time spent descheduled by other processes on a shared machine."""
    import torch

    with rt.context(), torch.inference_mode():
        c0, t0 = time.thread_time(), time.perf_counter()
        tr(**kw)
        return time.thread_time() - c0, time.perf_counter() - t0


def counts(tr: Any, rt: Any, kw: dict[str, Any]) -> dict[str, Any]:
    """Ops per block (last block) and per forward, and host sync points per forward, on a warm forward."""
    import torch

    from vllm_omni_ascend_opt.testbed.opcount import OpCounter, SyncCounter, count_module_calls

    with rt.context(), torch.inference_mode():
        tr(**kw)
        with SyncCounter() as syncs:
            tr(**kw)
    with rt.context(), torch.no_grad():
        tr(**kw)
        with count_module_calls(tr, OpCounter) as whole, count_module_calls(tr.transformer_blocks[-1]) as last:
            tr(**kw)
    return {
        "ops_per_block": last[0].total,
        "ops_per_forward": whole[0].total,
        "syncs_per_forward": syncs.total,
        "sync_sites": dict(syncs.sites),
    }


def profile(tr: Any, rt: Any, kw: dict[str, Any], n: int, top: int) -> str:
    """cProfile of ``n`` warm forwards: the ``top`` functions by own time (tottime), with per-forward microseconds."""
    import torch

    prof = cProfile.Profile()
    with rt.context(), torch.inference_mode():
        tr(**kw)
        prof.enable()
        for _ in range(n):
            tr(**kw)
        prof.disable()
    stats = pstats.Stats(prof)
    rows = []
    for (file, line, fn), (_cc, nc, tt, ct, _callers) in stats.stats.items():  # type: ignore[attr-defined]
        short = file.split("/site-packages/")[-1].split("/vllm_omni_ascend_opt/")[-1]
        rows.append((tt, ct, nc, f"{short}:{line}({fn})"))
    rows.sort(reverse=True)
    total = sum(r[0] for r in rows)
    out = io.StringIO()
    out.write(f"    total {total / n * 1e6:.0f} us/forward profiled (cProfile inflates Python-heavy code)\n")
    out.write(f"    {'own us/fwd':>10} {'cum us/fwd':>10} {'calls/fwd':>9}  function\n")
    for tt, ct, nc, name in rows[:top]:
        out.write(f"    {tt / n * 1e6:>10.1f} {ct / n * 1e6:>10.1f} {nc / n:>9.1f}  {name}\n")
    return out.getvalue()


def _model(rt: Any, depth: str) -> tuple[Any, dict[str, Any]]:
    """The benchmark's transformer (2 blocks, or 12 for ``deep``) and its inputs."""
    import torch

    from vllm_omni_ascend_opt.testbed import blockops
    from vllm_omni_ascend_opt.testbed.tiny_model import TINY_DEEP

    tr = blockops.build_transformer(rt, TINY_DEEP if depth == "deep" else blockops.TINY, torch.float32)
    return tr, blockops.t2i_inputs(tr, torch.float32, IMAGE, IMAGE)


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from vllm_omni_ascend_opt import api
    from vllm_omni_ascend_opt.testbed.runtime import init_cpu_runtime

    torch.set_num_threads(1)
    if args.quick:
        args.rounds, args.warm = 4, 15
    rt = init_cpu_runtime(None, dtype=torch.float32)
    tr, kw = _model(rt, args.depth)
    configs, skipped = configurations()
    if args.configs:
        wanted = args.configs.split(",")
        configs = {n: f for n, f in configs.items() if n in wanted or n == "stock"}
    rows: dict[str, dict[str, Any]] = {}
    for name, flags in configs.items():
        api.select(flags, model=tr)
        with left_out(name):
            rows[name] = {"flags": flags, **counts(tr, rt, kw), "warm_s": [], "wall_s": [], "round_median_s": []}
    for _ in range(args.rounds):
        for name, flags in configs.items():
            api.select(flags, model=tr)  # switching drops the memo: one cold forward first
            with left_out(name):
                forward_s(tr, rt, kw)
                times = [forward_s(tr, rt, kw) for _ in range(args.warm)]
            rows[name]["warm_s"] += [t[0] for t in times]
            rows[name]["wall_s"] += [t[1] for t in times]
            rows[name]["round_median_s"].append(statistics.median(t[0] for t in times))
    stock = rows["stock"]
    stock_median = statistics.median(stock["warm_s"])
    stock_wall = statistics.median(stock["wall_s"])
    for row in rows.values():
        ts = sorted(row["warm_s"])
        med = statistics.median(ts)
        q1, q3 = ts[len(ts) // 4], ts[(3 * len(ts)) // 4]
        row["us_per_forward"] = med * 1e6
        row["spread"] = (q3 - q1) / med
        row["ratio"] = med / stock_median
        ratios = [a / b for a, b in zip(row["round_median_s"], stock["round_median_s"], strict=True)]
        row["ratio_min"], row["ratio_max"] = min(ratios), max(ratios)
        row["us_per_op"] = row["us_per_forward"] / max(1, row["ops_per_forward"])
        row["wall_us_per_forward"] = statistics.median(row["wall_s"]) * 1e6
        row["wall_ratio"] = statistics.median(row["wall_s"]) / stock_wall
    for row in rows.values():
        del row["warm_s"], row["wall_s"]
    profiles = {}
    for name in filter(None, args.profile.split(",")):
        api.select(configs[name], model=tr)
        with left_out(name):
            profiles[name] = profile(tr, rt, kw, 200, args.profile_top)
    api.select("none", model=tr)
    return {
        "machine": {
            "cpu": platform.processor() or platform.machine(),
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "python": platform.python_version(),
            "loadavg": os.getloadavg(),
        },
        "model": f"tiny ({len(tr.transformer_blocks)} blocks, hidden {tr.inner_dim}), fp32, {IMAGE}x{IMAGE}",
        "rounds": args.rounds,
        "warm": args.warm,
        "configs": rows,
        "skipped": skipped,
        "profiles": profiles,
    }


def report(res: dict[str, Any]) -> str:
    m = res["machine"]
    load = ", ".join(f"{x:.2f}" for x in m["loadavg"])
    lines = [
        f"bench_host: host time per transformer forward, {res['model']}, B=1, warm, {res['rounds']} interleaved "
        f"rounds x {res['warm']} forwards",
        f"machine: {m['cpu']}, {m['threads']} thread, torch {m['torch']}, python {m['python']}; load average {load}",
        "",
        f"  {'config':<18} {'ops/block':>9} {'ops/fwd':>7} {'us/fwd':>8} {'spread':>7} {'ratio':>6} "
        f"{'round ratios':>13} {'us/op':>6} {'wall us':>8} {'ratio':>6} {'syncs/fwd':>9}",
    ]
    for name, r in res["configs"].items():
        lines.append(
            f"  {name:<18} {r['ops_per_block']:>9} {r['ops_per_forward']:>7} {r['us_per_forward']:>8.0f} "
            f"{r['spread'] * 100:>6.1f}% {r['ratio']:>6.3f} {r['ratio_min']:>6.3f}-{r['ratio_max']:<6.3f} "
            f"{r['us_per_op']:>6.2f} {r['wall_us_per_forward']:>8.0f} {r['wall_ratio']:>6.3f} "
            f"{r['syncs_per_forward']:>9}"
        )
    for name, why in res["skipped"].items():
        lines.append(f"  skipped {name}: {why}")
    lines.append("")
    lines.append("host sync points per forward, where (a denoise step = 1 forward without CFG, 2 with CFG):")
    for name in ("stock", "default", "all"):
        r = res["configs"].get(name)
        if r is None:
            continue
        sites = "; ".join(f"{n}x {s}" for s, n in sorted(r["sync_sites"].items())) or "none"
        lines.append(f"  {name}: {r['syncs_per_forward']}: {sites}")
    lines.append("")
    lines.append("us/fwd = median host time (the forward's thread CPU time: time descheduled by other processes is")
    lines.append("not counted) of a warm forward; spread = interquartile range / median; ratio = median / stock's")
    lines.append("median in this run; round ratios = min-max of the per-round median ratios; us/op = us/fwd / ops/fwd")
    lines.append(
        "(kernel-launching aten ops, views and allocations excluded, counted under no_grad); wall us / ratio ="
    )
    lines.append("the same on the wall clock (disturbed by load on a shared machine).")
    for name, text in res["profiles"].items():
        lines.append("")
        lines.append(f"profile of {name} (cProfile, 200 warm forwards, top by own time):")
        lines.append(text.rstrip())
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------------------
# --compiled: compiled default vs compiled stock at real width, one process per configuration
# ----------------------------------------------------------------------------------------------------------------
COMPILED_CONFIGS = {"stock": "none", "default": "default", "stock_ctrl": "none"}


def child(spec: str) -> int:
    """A --compiled worker: build the REAL-width transformer, select ``flags`` on it, compile it as vLLM-Omni does
    (``regionally_compile`` / ``module.compile()``), warm it up, then answer ``run N`` with N forward times."""
    import torch

    from vllm_omni_ascend_opt import api
    from vllm_omni_ascend_opt.testbed import blockops
    from vllm_omni_ascend_opt.testbed.runtime import init_cpu_runtime

    flags, granularity, size = spec.split("|")
    torch.set_num_threads(1)
    rt = init_cpu_runtime(None, dtype=torch.float32)
    tr = blockops.build_transformer(rt, blockops.REALWIDTH, torch.float32)
    kw = blockops.t2i_inputs(tr, torch.float32, int(size), int(size))
    api.select(flags, model=tr)
    if granularity == "full":
        tr.compile()
    else:
        from vllm_omni.diffusion.compile import regionally_compile

        regionally_compile(tr)
    with rt.context(), torch.inference_mode():
        for _ in range(3):
            tr(**kw)  # compiles on the first call
        print("ready", flush=True)
        for line in sys.stdin:
            cmd = line.split()
            if not cmd or cmd[0] == "quit":
                break
            times = []
            for _ in range(int(cmd[1])):
                t0 = time.perf_counter()
                tr(**kw)
                times.append(time.perf_counter() - t0)
            print(json.dumps(times), flush=True)
    return 0


def _reply(p: Any, is_reply: Callable[[str], bool]) -> str:
    """The worker's next reply line: vLLM-Omni's loggers also write to its stdout, so other lines are skipped
    ("" at end of output)."""
    for line in p.stdout:
        if is_reply(line.strip()):
            return line.strip()
    return ""


def run_compiled(args: argparse.Namespace) -> dict[str, Any]:
    """Interleaved rounds over one worker per configuration (stock, default and a second stock, whose distance from
    the first is the noise floor), per granularity; ratios of medians in this run."""
    import subprocess

    out: dict[str, Any] = {"size": args.compiled_size, "granularities": {}}
    rounds = 4 if args.quick else 8
    per_round = 3 if args.quick else 5
    for granularity in args.compiled.split(","):
        procs = {}
        for name, flags in COMPILED_CONFIGS.items():
            procs[name] = subprocess.Popen(
                [sys.executable, __file__, "--child", f"{flags}|{granularity}|{args.compiled_size}"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
                env={**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])},
            )
        try:
            for name, p in procs.items():
                line = _reply(p, lambda s: s == "ready")
                if line != "ready":
                    raise SystemExit(f"--compiled worker {name} ({granularity}) failed to start (exit {p.poll()})")
            times: dict[str, list[float]] = {n: [] for n in procs}
            for r in range(rounds):
                order = list(procs) if r % 2 == 0 else list(reversed(procs))
                for name in order:
                    p = procs[name]
                    p.stdin.write(f"run {per_round}\n")  # type: ignore[union-attr]
                    p.stdin.flush()  # type: ignore[union-attr]
                    times[name] += json.loads(_reply(p, lambda s: s.startswith("[")))
        finally:
            for p in procs.values():
                try:
                    p.stdin.write("quit\n")  # type: ignore[union-attr]
                    p.stdin.flush()  # type: ignore[union-attr]
                except (BrokenPipeError, OSError):
                    pass
            for p in procs.values():
                try:
                    p.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    p.kill()
        med = {n: statistics.median(t) * 1e3 for n, t in times.items()}
        noise = abs(med["stock_ctrl"] - med["stock"]) / med["stock"]
        ratio = med["default"] / med["stock"]
        out["granularities"][granularity] = {
            "median_ms": med,
            "ratio": ratio,
            "noise_floor": noise,
            "verdict": "not slower" if ratio <= 1 + noise else "SLOWER beyond the noise floor",
            "forwards": {n: len(t) for n, t in times.items()},
        }
    return out


def report_compiled(res: dict[str, Any]) -> str:
    lines = [
        f"bench_host --compiled: REAL width (hidden 3072, 24 heads x 128, 2 blocks), fp32, {res['size']}x{res['size']},"
        " 1 thread, inductor on CPU, one process per configuration, interleaved rounds (wall-clock per forward)",
    ]
    for g, r in res["granularities"].items():
        m = r["median_ms"]
        lines.append(
            f"  {g:<8}: stock {m['stock']:.1f} ms, default {m['default']:.1f} ms, ratio {r['ratio']:.3f}; "
            f"second stock {m['stock_ctrl']:.1f} ms: noise floor {r['noise_floor'] * 100:.1f}% -> {r['verdict']}"
        )
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------------------
# --instructions: instructions per forward under callgrind, one child per configuration
# ----------------------------------------------------------------------------------------------------------------
def child_instr(spec: str) -> int:
    """An --instructions child (run under callgrind): warm forwards, then ``n`` counted ones."""
    import instructions
    import torch

    from vllm_omni_ascend_opt import api
    from vllm_omni_ascend_opt.testbed.runtime import init_cpu_runtime

    flags, depth, n = spec.split("|")
    torch.set_num_threads(1)
    rt = init_cpu_runtime(None, dtype=torch.float32)
    tr, kw = _model(rt, depth)
    api.select(flags, model=tr)
    with rt.context(), torch.inference_mode():
        for _ in range(3):
            tr(**kw)
        instructions.measured(int(n), lambda: tr(**kw))
    return 0


def stock_default_all(args: argparse.Namespace) -> dict[str, str]:
    """Stock, default and all (or stock and the ``--configs`` named), name -> flags: what --split and --instructions
    measure (each optimization alone only when named)."""
    wanted = args.configs.split(",") if args.configs else ["default", "all"]
    return {n: f for n, f in configurations()[0].items() if n in wanted or n == "stock"}


def run_split(args: argparse.Namespace) -> str:
    """--split: interleaved rounds of warm forwards per configuration, each forward timed per segment."""
    import segments
    import torch

    from vllm_omni_ascend_opt.testbed.runtime import init_cpu_runtime

    torch.set_num_threads(1)
    if args.quick:
        args.rounds, args.warm = 4, 15
    rt = init_cpu_runtime(None, dtype=torch.float32)
    tr, kw = _model(rt, args.depth)
    rows = segments.measure(tr, rt, kw, stock_default_all(args), args.rounds, args.warm)
    header = (
        f"bench_host --split: tiny ({len(tr.transformer_blocks)} blocks, hidden {tr.inner_dim}), fp32, {IMAGE}x{IMAGE}, "
        f"1 thread, warm, {args.rounds} interleaved rounds x {args.warm} forwards"
    )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return "\n".join(segments.report(rows, header))


def run_instructions(args: argparse.Namespace) -> str:
    import instructions

    why = instructions.missing_tools()
    if why:
        raise SystemExit(f"--instructions: {why}")
    configs = stock_default_all(args)

    def argv(flags: str, n: int) -> list[str]:
        return [sys.executable, __file__, "--child-instr", f"{flags}|{args.depth}|{n}"]

    rows = instructions.count(argv, configs, args.instr_forwards)
    depth = "12 blocks" if args.depth == "deep" else "2 blocks"
    lines = [
        f"bench_host --instructions: tiny ({depth}, hidden 64), fp32, {IMAGE}x{IMAGE}, 1 thread, warm; instructions "
        f"per forward (callgrind, {args.instr_forwards} forwards per configuration, the switches' "
        f"{rows['switches'] / 1e6:.2f} M subtracted)",
        *instructions.report(rows),
        "",
        "kernel arithmetic = instructions in the functions that execute kernels (MKL, SLEEF, vectorized loops and",
        "reductions, CPU attention and norm kernels; benchmarks/instructions.py KERNEL_SYMBOLS): on an NPU that work",
        "runs on the device. host = the rest (interpreter, dispatcher, TensorIterator set-up, allocator).",
    ]
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if args.child:
        return child(args.child)
    if args.child_instr:
        return child_instr(args.child_instr)
    if args.instructions:
        print(run_instructions(args), flush=True)
        return 0
    if args.split:
        print(run_split(args), flush=True)
        return 0
    if args.compiled:
        res = run_compiled(args)
        print(report_compiled(res), flush=True)
        if args.json:
            args.json.write_text(json.dumps(res, indent=1))
        return 0
    res = run(args)
    print(report(res), flush=True)
    if args.json:
        args.json.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
