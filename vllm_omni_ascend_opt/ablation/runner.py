"""Run an ablation plan: one worker process per configuration, every measurement appended to ``--out`` as it happens
(its layout, lock, the log tagged with the plan's fingerprint, what a resume keeps: docs/ablation.md, "Robustness").

The order, from :mod:`.schedule`, is interleaved so that drift of the machine hits every configuration alike
(docs/ablation.md, "How the measurement stays honest"). A worker leads its own process group (with its engine
processes), driven over :mod:`.worker`'s protocol and paused, stopped or killed as one group (:mod:`.processes`).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from vllm_omni_ascend_opt.ablation import schedule
from vllm_omni_ascend_opt.ablation.plan import Config, Plan, accelerator_visible
from vllm_omni_ascend_opt.ablation.processes import Worker, WorkerFailed, load1, stop_all
from vllm_omni_ascend_opt.ablation.schedule import Measured, measured
from vllm_omni_ascend_opt.ablation.worker import PROTOCOL_VERSION

#: Files and folders the runner owns inside --out (``--fresh`` removes exactly these).
OWNED = ("plan.json", "measurements.jsonl", "results.json", "report.md", "ablation.png", "configs", "images", ".lock")


class RunError(RuntimeError):
    """The run cannot start (bad --out directory, a different run stored there, locked)."""


class OutDir:
    """The paths inside ``--out``, and the lock that keeps two runs out of one directory."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.plan_json = self.root / "plan.json"
        self.log = self.root / "measurements.jsonl"

    def config_dir(self, cid: str) -> Path:
        return self.root / "configs" / cid

    def image_stem(self, cid: str, prompt: int, seed: int) -> Path:
        return self.root / "images" / cid / f"p{prompt}_s{seed}"

    def prepare(self, fingerprint: str, fresh: bool) -> bool:
        """Create/lock the directory. Returns True when earlier measurements of the same plan are there."""
        if self.root.exists() and not self.root.is_dir():
            raise RunError(f"--out {self.root} exists and is not a directory")
        self.root.mkdir(parents=True, exist_ok=True)
        self._lock()  # before --fresh removes anything: never under a live run's feet
        if fresh:
            for p in (self.root / name for name in OWNED if name != ".lock"):
                if p.is_dir():
                    shutil.rmtree(p)
                elif p.exists():
                    p.unlink()
        if self.plan_json.is_file():
            old = self.stored_fingerprint()
            if old != fingerprint:
                self.unlock()
                raise RunError(
                    f"{self.root} holds results of a different run (plan fingerprint {old} != {fingerprint}); "
                    "use --fresh to replace them or choose another --out"
                )
            return self.log.is_file()
        return False

    def stored_fingerprint(self) -> str | None:
        """The fingerprint in the directory's plan.json, None without a readable one."""
        with contextlib.suppress(OSError, ValueError):
            return json.loads(self.plan_json.read_text()).get("fingerprint")
        return None

    def _lock(self) -> None:
        lock = self.root / ".lock"
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            pid = 0
            with contextlib.suppress(OSError, ValueError):
                pid = int(lock.read_text().strip() or 0)
            if pid and _alive(pid):
                raise RunError(f"{self.root} is in use by another ablation run (pid {pid})") from None
            lock.unlink(missing_ok=True)
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        os.write(fd, str(os.getpid()).encode())
        os.close(fd)

    def unlock(self) -> None:
        with contextlib.suppress(OSError):
            (self.root / ".lock").unlink()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, someone else's
        pass
    return True


class Store:
    """Append-only JSON-lines log of everything measured, tagged with the plan fingerprint."""

    def __init__(self, path: Path, fingerprint: str) -> None:
        self.path = path
        self.fp = fingerprint
        self.records: list[dict[str, Any]] = []

    def load(self) -> list[dict[str, Any]]:
        out = []
        if self.path.is_file():
            for line in self.path.read_text().splitlines():
                with contextlib.suppress(ValueError):
                    rec = json.loads(line)
                    if isinstance(rec, dict) and rec.get("fp") == self.fp:
                        out.append(rec)
        return out

    def rewrite(self, records: list[dict[str, Any]]) -> None:
        tmp = self.path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(json.dumps(rec) + "\n" for rec in records))
        os.replace(tmp, self.path)
        self.records = list(records)

    def add(self, rec: dict[str, Any]) -> dict[str, Any]:
        rec = {"fp": self.fp, "t": time.time(), **rec}
        with open(self.path, "a") as f:
            f.write(json.dumps(rec) + "\n")
        self.records.append(rec)
        return rec


def select_resumable(plan: Plan, records: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], int]:
    """The records a resume keeps and how many measurements it drops: unfinished rounds (resident) or processes."""
    failed = {r["config"] for r in records if r.get("type") == "failure"}
    samples = set(plan.samples)
    complete_units = {k for k, v in measured(records).items() if samples <= v}
    if plan.schedule == "resident":
        live = [c.id for c in plan.configs if c.id not in failed]
        rounds = {r for r in range(plan.workload.repeats) if all((c, r) in complete_units for c in live)}
        keep_unit = {(c.id, r) for c in plan.configs for r in rounds}
    else:
        keep_unit = complete_units
    kept, dropped = [], 0
    for r in records:
        if r.get("type") != "sample" or (r["config"], r["round"]) in keep_unit or r["config"] in failed:
            kept.append(r)
        elif not r.get("warmup"):
            dropped += 1
    return kept, dropped


WORKER_MODULE = "vllm_omni_ascend_opt.ablation.worker"
#: Workload fields a worker's job carries as they are.
JOB_FIELDS = (
    "model dtype height width steps negative_prompt image prompts seeds enforce_eager od_config threads "
    "vae_decode_repeats timeout_s start_timeout_s".split()
)
#: The worker's result fields a sample record keeps.
RESULT_FIELDS = ("total_ms", "stages_ms", "cpu_ms", "others_cpu", "sha256")
T = TypeVar("T")


@dataclass
class RunData:
    """What the analysis needs: the plan and every kept record."""

    plan: Plan
    out: OutDir
    records: list[dict[str, Any]]
    dropped_on_resume: int = 0
    resumed: bool = False
    interrupted: bool = False
    wall_s: float = 0.0


def _step(bar: Any, desc: str) -> None:
    """One step of the run's progress bar (starts, warm-ups, measurements)."""
    bar.set_description(desc, refresh=False)
    bar.update(1)


class Runner:
    """One run of ``plan`` into the output directory ``out`` (resumed when it holds this plan's measurements)."""

    def __init__(
        self,
        plan: Plan,
        out: Path | str,
        *,
        fresh: bool = False,
        progress: bool = True,
        worker_cmd: list[str] | None = None,
        log: Any = None,
    ) -> None:
        self.plan = plan
        self.wl = plan.workload
        self.out = OutDir(Path(out))
        self.fresh = fresh
        self.progress_enabled = progress
        self.worker_cmd = worker_cmd or [sys.executable, "-m", WORKER_MODULE]
        self.say = log or (lambda msg: print(msg, file=sys.stderr))
        self.failed: dict[str, dict[str, Any]] = {}

    def _job(self, c: Config) -> Path:
        wl = self.wl
        job = {
            "protocol": PROTOCOL_VERSION,
            "config": {"id": c.id, "opts": list(c.opts), "spec": c.spec},
            "engine": self.plan.engine,
            "model_path": self.plan.model_path,
            **{k: getattr(wl, k) for k in JOB_FIELDS},
            "od_config": c.od_config(wl.od_config),  # the information configuration drops the quantization
            "cfg_scale": float(wl.cfg_scale),
            "max_sequence_length": wl.seq_len(),
            "vae_tiling": list(wl.vae_tiling) if wl.vae_tiling else None,
            "imports": list(self.plan.extra_imports),
        }
        path = self.out.config_dir(c.id) / "job.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(job, indent=1))
        return path

    def _env(self, c: Config) -> dict[str, str]:
        env = dict(os.environ)
        env["VLLM_OMNI_ASCEND_OPT"] = c.spec
        env["VLLM_OMNI_ASCEND_OPT_STRICT"] = "1"  # a selected optimization that cannot be active fails loudly
        env.setdefault("TOKENIZERS_PARALLELISM", "false")
        env["PYTHONUNBUFFERED"] = "1"
        env.setdefault("VLLM_LOGGING_COLOR", "0")
        if self.wl.threads:
            # the engine processes a worker starts (omni's mp worker, a server) take their torch thread count from it
            env["OMP_NUM_THREADS"] = str(self.wl.threads)
        if self.plan.engine in ("omni", "serve") and not accelerator_visible():
            # vLLM-Omni's own engines on a CPU-only machine: the test bed's opt-in CPU runtime in all their processes
            from vllm_omni_ascend_opt.testbed.runtime import engine_env

            env = engine_env(env)
        return env

    def spawn(self, c: Config) -> Worker:
        """A worker process for configuration ``c``, with its job file and log."""
        argv = [*self.worker_cmd, "--job", str(self._job(c))]
        return Worker(c, argv, self._env(c), self.out.config_dir(c.id) / "worker.log")

    def _fail(self, w: Worker, rnd: int | None, exc: WorkerFailed) -> None:
        c, tail, rc = w.config, w.log_tail(), w.proc.poll()
        what = {"phase": exc.phase, "error": exc.error, "traceback": exc.tb, "returncode": rc, "log_tail": tail}
        self.failed[c.id] = self.store.add({"type": "failure", "config": c.id, "round": rnd, **what})
        self.say(
            f"configuration {c.id} failed ({exc.phase}): {exc.error}  [log: {self.out.config_dir(c.id)}/worker.log]"
        )
        w.stop(0)

    def _save_stem(self, c: Config, prompt: int, seed: int) -> str | None:
        stem = self.out.image_stem(c.id, prompt, seed)
        if stem.with_suffix(".png").is_file() and (
            self.plan.engine in ("omni", "serve") or stem.with_suffix(".npy").is_file()
        ):
            return None
        return str(stem)

    def _record_sample(
        self, w: Worker, rnd: int, prompt: int, seed: int, warmup: bool, ev: dict[str, Any], prog: Any
    ) -> None:
        rec = {"type": "sample", "config": w.config.id, "round": rnd, "prompt": prompt, "seed": seed, "warmup": warmup}
        pid = (w.ready or {}).get("pid")
        self.store.add({**rec, **{k: ev.get(k) for k in RESULT_FIELDS}, "load1": load1(), "pid": pid})
        _step(prog, f"warm-up {w.config.id}" if warmup else f"round {rnd + 1}/{self.wl.repeats}")

    def _await_ready(self, w: Worker, rnd: int | None) -> None:
        ev = w.wait_ready(self.wl.start_timeout_s)
        ready = {k: ev.get(k) for k in ("pid", "load_s", "env", "active", "memory")}
        self.store.add({"type": "ready", "config": w.config.id, "round": rnd, **ready})

    def _warmup(self, w: Worker, rnd: int, prog: Any) -> None:
        samples = self.plan.samples
        for i in range(self.wl.warmup):
            p, s = samples[i % len(samples)]
            ev = w.run(p, s, None, self.wl.timeout_s)
            self._record_sample(w, rnd, p, s, True, ev, prog)

    def run(self) -> RunData:
        t0 = time.perf_counter()
        fp = self.plan.fingerprint()
        resumed = self.out.prepare(fp, self.fresh)
        try:
            self.out.plan_json.write_text(json.dumps(self.plan.to_dict(), indent=1))
            self.store = Store(self.out.log, fp)
            kept, dropped = select_resumable(self.plan, self.store.load()) if resumed else ([], 0)
            self.store.rewrite(kept)
            self.failed.update({r["config"]: r for r in kept if r.get("type") == "failure"})
            if resumed:
                done = sum(1 for r in kept if r.get("type") == "sample" and not r.get("warmup"))
                self.say(
                    f"resuming in {self.out.root}: {done} measurement(s) kept, {dropped} from unfinished units "
                    f"dropped, {len(self.failed)} failed configuration(s) kept as failed"
                )
            interrupted = False
            try:
                self._measure()
            except KeyboardInterrupt:
                interrupted = True
                self.say("interrupted: what finished is kept in measurements.jsonl; rerun the same command to resume")
            return RunData(
                self.plan, self.out, list(self.store.records), dropped, resumed, interrupted, time.perf_counter() - t0
            )
        finally:
            self.out.unlock()

    def _measure(self) -> None:
        """Every (configuration, round) still to measure: resident (process sets of live workers) or per round."""
        from tqdm.auto import tqdm

        todo = schedule.todo(self.plan, self.store.records, self.failed)
        resident = self.plan.schedule == "resident"
        starts = len(todo)
        if resident:
            left = {r for _, r in todo}
            sets = [[r for r in b if r in left] for b in schedule.process_sets(self.wl.repeats, self.wl.process_sets)]
            sets = [b for b in sets if b]
            starts = sum(len({c for c, r in todo if r in b}) for b in sets)
        total = starts * (1 + self.wl.warmup) + sum(len(v) for v in todo.values())
        on = self.progress_enabled and total > 0
        with tqdm(total=total, unit="step", file=sys.stderr, dynamic_ncols=True, leave=True, disable=not on) as prog:
            if resident:
                for i, b in enumerate(sets):
                    self._resident_set(b, todo, prog, schedule.start_order(self.plan.configs, i))
                return
            for rnd in range(self.wl.repeats):
                for c in schedule.rotation(self.plan.configs, rnd):
                    if (c.id, rnd) in todo and c.id not in self.failed:
                        self._per_round_process(c, rnd, prog)

    def _resident_set(self, rounds: list[int], todo: Measured, prog: Any, start_order: list[Config]) -> None:
        """One process set: a worker per configuration with work left in ``rounds``: start, warm up, measure, stop."""
        configs = [c for c in start_order if c.id not in self.failed and any((c.id, r) in todo for r in rounds)]
        if not configs:
            return
        workers: dict[str, Worker] = {}
        starting: list[Worker] = []
        try:
            self._start_all(configs, workers, starting, prog)
            # warm-up in turn once every worker is up: one left idle after its warm-up runs its first requests slower
            order = [c for c in self.plan.configs if c.id in workers]
            for c in order:
                self._turn(workers, c, None, self._warmup, rounds[0], prog)
            order = [c for c in order if c.id in workers]
            samples = self.plan.samples
            for rnd in rounds:
                for k, (p, s) in enumerate(samples):
                    live = [c for c in order if c.id in workers and c.id not in self.failed]
                    if not live:
                        return
                    for c in schedule.step_order(live, rnd * len(samples) + k):
                        if (p, s) not in todo.get((c.id, rnd), set()):
                            continue
                        stem = self._save_stem(c, p, s)
                        ev = self._turn(workers, c, rnd, Worker.run, p, s, stem, self.wl.timeout_s)
                        if ev is None:
                            continue
                        self._record_sample(workers[c.id], rnd, p, s, False, ev, prog)
        except BaseException:
            for w in [*workers.values(), *starting]:
                w.kill()
            raise
        finally:
            stop_all([*workers.values(), *starting])

    def _start_all(self, configs: list[Config], workers: dict[str, Worker], starting: list[Worker], prog: Any) -> None:
        """Start ``configs``' workers, ``start_jobs`` at a time, into ``workers`` once ready (``starting``: not yet)."""
        pending = list(configs)
        while pending or starting:
            while pending and len(starting) < self.wl.start_jobs:
                starting.append(self.spawn(pending.pop(0)))
            for w in list(starting):
                if not w.events.empty():  # ready, an error, or eof
                    starting.remove(w)
                    try:
                        self._await_ready(w, None)
                        _step(prog, f"started {w.config.id}")
                        workers[w.config.id] = w
                        if self.wl.pause_idle:
                            w.pause()
                    except WorkerFailed as exc:
                        self._fail(w, None, exc)
                elif time.monotonic() - w.t_start > self.wl.start_timeout_s:
                    starting.remove(w)
                    self._fail(w, None, WorkerFailed("start", "not ready in time (worker killed)"))
            time.sleep(0.05)

    def _turn(
        self, workers: dict[str, Worker], c: Config, rnd: int | None, action: Callable[..., T], *args: Any
    ) -> T | None:
        """``action(worker, *args)`` on ``c``'s running worker; None when it failed (recorded and removed)."""
        w = workers[c.id]
        try:
            w.resume()
            result = action(w, *args)
            if self.wl.pause_idle:
                w.pause()
        except WorkerFailed as exc:
            self._fail(w, rnd, exc)
            del workers[c.id]
            return None
        return result

    def _per_round_process(self, c: Config, rnd: int, prog: Any) -> None:
        """One configuration's process of round ``rnd``: start, warm up, every sample once, exit."""
        w = self.spawn(c)
        try:
            self._await_ready(w, rnd)
            _step(prog, f"started {c.id} (round {rnd + 1})")
            self._warmup(w, rnd, prog)
            for p, s in self.plan.samples:
                ev = w.run(p, s, self._save_stem(c, p, s), self.wl.timeout_s)
                self._record_sample(w, rnd, p, s, False, ev, prog)
        except WorkerFailed as exc:
            self._fail(w, rnd, exc)
        except BaseException:
            w.kill()
            raise
        finally:
            w.stop()
