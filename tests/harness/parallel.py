"""Run the tiny Qwen-Image under vLLM-Omni's parallel modes with real process groups (gloo workers) on CPU.

Per mode each worker initialises vLLM-Omni's parallel state as its diffusion worker does, loads the pipeline through
vLLM-Omni's loader (``_sp_plan`` hooks in SP modes) and runs every :class:`Job` with its spec selected, reporting per
rank what it saw. A failing rank or the deadline kills every worker; an orphaned worker exits on its own.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tests.harness import LogLines

#: Parallel mode name (the keys of ``Optimization.parallel_support``) -> (DiffusionParallelConfig fields, world size).
MODES: dict[str, tuple[dict[str, int], int]] = {
    "single": ({}, 1),
    "ulysses": ({"ulysses_degree": 2}, 2),
    "ring": ({"ring_degree": 2}, 2),
    "cfg_parallel": ({"cfg_parallel_size": 2}, 2),
    "tensor_parallel": ({"tensor_parallel_size": 2}, 2),
}

_SP_LOG_MARK = "Applying sequence parallelism"


class ParallelRunError(RuntimeError):
    """A worker failed or the deadline passed; the message holds each rank's log tail, ``pids`` the (reaped) workers."""

    def __init__(self, message: str, pids: list[int]) -> None:
        super().__init__(message)
        self.pids = pids


@dataclass(frozen=True)
class Job:
    """One generation request, run on every rank with ``spec`` selected on the pipeline."""

    spec: str
    height: int = 32
    width: int = 32
    steps: int = 2
    seed: int = 0
    cfg_scale: float = 4.0
    prompt: str = "a red cat"
    negative_prompt: str | None = None
    mask_sp_padding: bool | None = None  # for this job only (None: vLLM-Omni's value)
    tag: str = ""
    #: ``"module:function"`` called with the rank before selecting ``spec`` / after the job (returns JobReport.extra).
    before: str | None = None
    after: str | None = None
    image: int | None = None  # Edit pipelines: seed of the test bed's sample input image

    @property
    def key(self) -> str:
        return self.tag or f"{self.spec}@{self.height}x{self.width}"

    def generate(self, pipe: Any, rt: Any) -> Any:
        """Run this request on ``pipe`` with whatever is selected on it now."""
        from vllm_omni_ascend_opt.testbed.pipeline import generate, sample_image

        kw = {k: getattr(self, k) for k in ("height", "width", "steps", "seed", "cfg_scale", "negative_prompt")}
        image = None if self.image is None else sample_image(self.image)
        return generate(pipe, rt, self.prompt, image=image, **kw)


@dataclass(frozen=True)
class ModeRun:
    """One parallel mode in a spawn: its jobs, in order, on a pipeline built in ``dtype`` from ``model_dir`` (None:
    the spawn's model); ``tag`` tells apart runs of one mode and dtype on other models."""

    mode: str
    jobs: tuple[Job, ...]
    dtype: str = "float32"
    model_dir: str | None = None
    tag: str = ""

    @property
    def key(self) -> str:
        key = self.mode if self.dtype == "float32" else f"{self.mode}@{self.dtype}"
        return f"{self.tag}:{key}" if self.tag else key


@dataclass
class JobReport:
    """What one rank saw while running one :class:`Job`; the dicts are keyed by selected optimization."""

    job: Job
    images: torch.Tensor
    selected: list[str]
    installed: list[str]
    acting: list[str]  # installed, attached and without model-level reasons to be off
    reasons: dict[str, list[str]]  # why not acting (environment- and model-level)
    env_reasons: dict[str, list[str]]  # reasons_inactive() only (empty: it must be installed)
    stats: dict[str, Any]
    fallbacks: dict[str, Any]
    sp_padding: list[tuple[int | None, int]]  # (image tokens before padding, padding) per transformer forward
    extra: Any = None
    collectives: dict[str, list[int]] = field(default_factory=dict)  # op -> [calls, bytes] (CollectiveCounter)


@dataclass
class RankReport:
    rank: int
    groups: dict[str, int]  # {sp,ulysses,ring,cfg,tp}_{rank,size} as vLLM-Omni sees them
    sp_hooks: list[str]  # the SP hooks on the transformer after loading
    sp_log: list[str]  # vLLM-Omni's "Applying sequence parallelism" log lines while loading
    active_modes: list[str]
    jobs: list[JobReport]

    def job(self, key: str) -> JobReport:
        for j in self.jobs:
            if j.job.key == key:
                return j
        raise KeyError(f"no job {key!r}; have {[j.job.key for j in self.jobs]}")


@dataclass
class ParallelRun:
    mode: str
    world_size: int
    ranks: list[RankReport]
    dtype: str

    def images(self, key: str, rank: int = 0) -> torch.Tensor:
        return self.ranks[rank].job(key).images


def run_parallel(mode: str, jobs: list[Job], **kwargs: Any) -> ParallelRun:
    """Run ``jobs`` in ``mode`` (a key of :data:`MODES`) on fresh worker processes; see :func:`run_parallel_modes`."""
    run = ModeRun(mode, tuple(jobs))
    return run_parallel_modes([run], **kwargs)[run.key]


def run_parallel_modes(
    plan: list[ModeRun],
    *,
    model_dir: str | os.PathLike | None = None,
    timeout_s: float = 180.0,
    setup: str | None = None,
    pythonpath: list[str] | None = None,
) -> dict[str, ParallelRun]:
    """Run each :class:`ModeRun` in turn in the same fresh workers; the reports by :attr:`ModeRun.key`.

    ``setup`` (``"module:function"``, called with the rank) runs first in each worker; ``pythonpath`` is prepended to
    theirs. Raises :class:`ParallelRunError` when a rank fails or ``timeout_s`` passes; no worker outlives this call.
    """
    from vllm_omni_ascend_opt.testbed.runtime import free_port
    from vllm_omni_ascend_opt.testbed.tiny_model import build_model_dir

    for run in plan:
        if run.mode not in MODES:
            raise ValueError(f"unknown parallel mode {run.mode!r}; valid: {', '.join(MODES)}")
        if not isinstance(getattr(torch, run.dtype, None), torch.dtype):
            raise ValueError(f"unknown dtype {run.dtype!r}")
        keys = [j.key for j in run.jobs]
        if len(set(keys)) != len(keys):
            raise ValueError(f"{run.key}: job keys must be unique: {keys}")
    if len({r.key for r in plan}) != len(plan):
        raise ValueError(f"mode runs need distinct keys: {[r.key for r in plan]}")
    sizes = {MODES[r.mode][1] for r in plan}
    if len(sizes) != 1:
        raise ValueError(f"modes of one spawn must share a world size: {[(r.mode, MODES[r.mode][1]) for r in plan]}")
    (world_size,) = sizes
    model_dir = str(model_dir or build_model_dir())
    t0 = time.monotonic()  # the deadline's start
    with tempfile.TemporaryDirectory(prefix="ascend-opt-parallel-") as tmp:
        work = Path(tmp)
        cfg = {
            "runs": [
                {
                    "mode": run.mode,
                    "dtype": run.dtype,
                    "model_dir": run.model_dir or model_dir,
                    "parallel": MODES[run.mode][0],
                    "init_method": f"tcp://127.0.0.1:{free_port()}",
                    "jobs": [dataclasses.asdict(j) for j in run.jobs],
                }
                for run in plan
            ],
            "world_size": world_size,
            "model_dir": model_dir,
            "setup": setup,
            "deadline": time.time() + timeout_s + 10.0,  # the orphans' watchdog: after the parent's deadline
            "parent_pid": os.getpid(),
        }
        (work / "config.json").write_text(json.dumps(cfg))
        child_env = dict(os.environ)
        child_env.update(
            {
                "OMP_NUM_THREADS": "1",
                "MKL_NUM_THREADS": "1",
                "TOKENIZERS_PARALLELISM": "false",
                "VLLM_OMNI_ASCEND_OPT": "default",
                "MASTER_ADDR": "127.0.0.1",
                "GLOO_SOCKET_IFNAME": child_env.get("GLOO_SOCKET_IFNAME", "lo"),
                # every rank checks its kernels itself (no saved verdicts): the ranks' kernel calls compare one to one
                "VLLM_OMNI_ASCEND_OPT_VERDICT_CACHE": "off",
            }
        )
        # the workers run this module as tests.harness.parallel: the repository root is on their path
        paths = [*(pythonpath or ()), str(Path(__file__).resolve().parents[2]), child_env.get("PYTHONPATH", "")]
        child_env["PYTHONPATH"] = os.pathsep.join(paths).rstrip(os.pathsep)
        procs: list[subprocess.Popen] = []
        try:
            for rank in range(world_size):
                with open(work / f"rank{rank}.log", "wb") as log:  # the worker keeps its own descriptor
                    procs.append(
                        subprocess.Popen(
                            [sys.executable, "-m", "tests.harness.parallel", str(work), str(rank)],
                            stdout=log,
                            stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL,
                            env=child_env,
                            start_new_session=True,  # its own process group: killpg reaches anything it starts
                        )
                    )
            _wait_all(procs, work, deadline=t0 + timeout_s)
            per_rank: list[list[RankReport]] = [
                torch.load(work / f"rank{r}.pt", weights_only=False) for r in range(world_size)
            ]
        finally:
            _kill_all(procs)
    return {
        run.key: ParallelRun(run.mode, world_size, [reports[i] for reports in per_rank], run.dtype)
        for i, run in enumerate(plan)
    }


def _wait_all(procs: list[subprocess.Popen], work: Path, deadline: float) -> None:
    while True:
        codes = [p.poll() for p in procs]
        failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
        if all(c == 0 for c in codes):
            return
        if failed or time.monotonic() > deadline:
            what = f"rank(s) {failed} failed (exit codes {codes})" if failed else f"timed out (exit codes {codes})"
            logs = [(work / f"rank{r}.log").read_text(errors="replace")[-4000:] for r in range(len(procs))]
            tails = "".join(f"\n----- rank {r} log tail -----\n{t}" for r, t in enumerate(logs))
            raise ParallelRunError(f"{what}; workers killed{tails}", [p.pid for p in procs])
        time.sleep(0.1)


def _kill_all(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGKILL)
    for p in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=10)


def _watchdog(deadline: float, parent_pid: int) -> None:
    """Exit hard when the deadline passes or the parent is gone (a hung collective never ends on its own)."""
    while True:
        if time.time() > deadline or os.getppid() != parent_pid:
            print("vllm-omni-ascend-opt parallel worker: deadline passed or parent gone; exiting", flush=True)
            os._exit(3)
        time.sleep(0.5)


def _group_facts() -> dict[str, int]:
    import vllm.distributed as vd
    from vllm_omni.diffusion.distributed import parallel_state as ps

    facts = {}
    groups = {"sp": "sequence_parallel", "ulysses": "ulysses_parallel", "ring": "ring_parallel"}
    groups |= {"cfg": "classifier_free_guidance", "tp": "tensor_model_parallel"}
    for key, group in groups.items():
        with contextlib.suppress(Exception):
            mod = vd if key == "tp" else ps
            facts[f"{key}_rank"] = int(getattr(mod, f"get_{group}_rank")())
            facts[f"{key}_size"] = int(getattr(mod, f"get_{group}_world_size")())
    return facts


def _sp_hooks(transformer: Any) -> list[str]:
    regs = [getattr(m, "_hook_registry", None) for m in transformer.modules()]
    return sorted(n for r in regs if r is not None for n in getattr(r, "_hooks", {}) if n.startswith("sp_"))


def _plain(value: Any) -> Any:
    try:
        return json.loads(json.dumps(value, default=repr))  # plain data only across processes
    except (TypeError, ValueError):
        return repr(value)


def _job_facts(pipe: Any) -> dict[str, Any]:
    from vllm_omni_ascend_opt import _plugin, _report, api, registry

    selected = _plugin.selected()
    out = dict(
        selected=selected, installed=api.installed(), acting=[], reasons={}, env_reasons={}, stats={}, fallbacks={}
    )
    for opt in registry.all_optimizations():
        if opt.name not in selected:
            continue
        why = out["reasons"][opt.name] = _report.explain(opt, pipe)
        out["env_reasons"][opt.name] = list(opt.reasons_inactive())
        if not why:
            out["acting"].append(opt.name)
        if opt.stats:
            out["stats"][opt.name] = _plain(dict(opt.stats))
        if f := _plain(opt.fallback_reasons()):
            out["fallbacks"][opt.name] = f
    return out


def _call_hook(ref: str | None, rank: int) -> Any:
    if not ref:
        return None
    mod_name, fn_name = ref.split(":")
    return getattr(importlib.import_module(mod_name), fn_name)(rank)


def _worker(work: Path, rank: int) -> None:
    cfg = json.loads((work / "config.json").read_text())
    threading.Thread(target=_watchdog, args=(cfg["deadline"], cfg["parent_pid"]), daemon=True).start()
    torch.set_num_threads(1)
    _call_hook(cfg["setup"], rank)
    capture = LogLines(_SP_LOG_MARK, logging.INFO)
    sp_logger = logging.getLogger("vllm_omni.diffusion.registry")
    sp_logger.addHandler(capture)
    if sp_logger.getEffectiveLevel() > logging.INFO:
        sp_logger.setLevel(logging.INFO)

    torch.save([_run_mode(cfg, run, rank, capture) for run in cfg["runs"]], work / f"rank{rank}.pt")


def _run_mode(cfg: dict[str, Any], run: dict[str, Any], rank: int, capture: LogLines) -> RankReport:
    import gc

    from vllm_omni.diffusion.forward_context import get_forward_context

    from vllm_omni_ascend_opt import _parallel, api
    from vllm_omni_ascend_opt.devtime.layouts import CollectiveCounter
    from vllm_omni_ascend_opt.testbed.pipeline import load_pipeline
    from vllm_omni_ascend_opt.testbed.runtime import init_cpu_runtime, shutdown

    capture.lines.clear()
    api.select("default")  # before the model modules are imported (patches go in on import) and built
    rt = init_cpu_runtime(
        run["model_dir"],
        parallel=run["parallel"],
        rank=rank,
        world_size=cfg["world_size"],
        init_method=run["init_method"],
        dtype=getattr(torch, run["dtype"]),
    )
    pipe = load_pipeline(rt)
    hooks = _sp_hooks(pipe.transformer)  # the ground truth of "the _sp_plan was applied"

    seen: list[tuple[int | None, int]] = []

    def probe(_module: Any, _args: Any) -> None:  # runs inside the transformer forward, after the SP split
        ctx = get_forward_context()
        seen.append((ctx.sp_original_seq_len, int(ctx.sp_padding_size)))

    handle = pipe.transformer.norm_out.register_forward_pre_hook(probe)
    pc = pipe.transformer.parallel_config
    mask_default = pc.mask_sp_padding
    jobs = []
    for jd in run["jobs"]:  # a failing job ends the worker: nothing to restore
        job = Job(**jd)
        pc.mask_sp_padding = mask_default if job.mask_sp_padding is None else job.mask_sp_padding
        _call_hook(job.before, rank)
        api.select(job.spec, model=pipe)
        seen.clear()
        with CollectiveCounter() as coll:
            res = job.generate(pipe, rt)
        facts = _job_facts(pipe)  # before the after-hook, which may change the selection
        extra = _plain(_call_hook(job.after, rank))
        jobs.append(JobReport(job, res.images, sp_padding=list(seen), extra=extra, collectives=coll.as_dict(), **facts))
    handle.remove()
    report = RankReport(
        rank=rank,
        groups=_group_facts(),
        sp_hooks=hooks,
        sp_log=list(capture.lines),
        active_modes=_parallel.active_modes(pipe),
        jobs=jobs,
    )
    api.select("none", model=pipe)  # detach before the model goes
    del pipe
    gc.collect()
    shutdown()
    return report


if __name__ == "__main__":
    # Run the worker from the package module (not __main__) so its reports unpickle in the parent.
    from tests.harness import parallel as _this

    code = 0
    try:
        _this._worker(Path(sys.argv[1]), int(sys.argv[2]))
    except BaseException:  # a failing rank exits at once, with its traceback, instead of hanging in teardown
        import traceback

        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # skip interpreter teardown of vLLM's atexit handlers (they can block on a torn-down group)
