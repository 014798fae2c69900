"""Run an ablation plan: worker processes, interleaving, persistence and resume.

Schedules (both give every configuration its own fresh process and interleave configurations, so that drift of the
machine hits all of them alike):

* ``resident`` (default for the tiny model): one worker per configuration, all alive at once. Workers start
  ``start_jobs`` at a time; once every worker is ready, each warms up in turn, and measuring starts.
  With ``process_sets`` > 1 the rounds are split into that many consecutive blocks, each measured by a freshly started
  set of workers, so that process-level effects (memory placement) are drawn more than once; every other block
  starts the configurations in reverse order, so that effects of the start order cancel too. With ``pause_idle``
  every worker's process group is stopped (SIGSTOP) outside its own turn and continued (SIGCONT) for it, so the idle
  polling of resident engines and servers does not compete with the configuration being measured.
  Then, for each round (= one repeat) and each sample (prompt x seed), every configuration runs once, in the orders
  of a Williams design (:func:`williams_orders`), one per step in turn: every configuration runs at every position
  and right after every other configuration equally often, so neither a position nor a neighbour (whose cache
  footprint the next one inherits) favours one configuration. Workers
  block on their stdin between requests. Costs one model copy per configuration in memory.
* ``per-round`` (default for a real checkpoint, where one device holds one copy of the model): for each round, the
  configurations run one after another, rotated per round, each in a fresh process that loads the model, warms up,
  runs every sample once and exits.

Everything is appended to ``<out>/measurements.jsonl`` as it happens (tagged with the plan's fingerprint). A rerun
with the same plan resumes: complete units are kept (resident: complete rounds; per-round: complete
(configuration, round) processes), partial ones are measured again, and configurations that failed stay failed
(``--fresh`` starts over).
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_omni_ascend_opt.ablation.plan import Config, Plan, _accelerator_visible
from vllm_omni_ascend_opt.ablation.protocol import PROTOCOL_VERSION, decode

WORKER_MODULE = "vllm_omni_ascend_opt.ablation.worker"
#: Files and folders the runner owns inside --out (``--fresh`` removes exactly these).
OWNED = ("plan.json", "measurements.jsonl", "results.json", "report.md", "ablation.png", "configs", "images", ".lock")


class RunError(RuntimeError):
    """The run cannot start (bad --out directory, a different run stored there, locked)."""


class WorkerFailed(RuntimeError):
    def __init__(self, phase: str, error: str, tb: str = "") -> None:
        super().__init__(error)
        self.phase, self.error, self.tb = phase, error, tb


# ----------------------------------------------------------------------------------------------------------------
# the output directory
# ----------------------------------------------------------------------------------------------------------------
class OutDir:
    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    @property
    def plan_json(self) -> Path:
        return self.root / "plan.json"

    @property
    def log(self) -> Path:
        return self.root / "measurements.jsonl"

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
            for name in OWNED:
                p = self.root / name
                if name == ".lock":
                    continue
                if p.is_dir():
                    shutil.rmtree(p)
                elif p.exists():
                    p.unlink()
        if self.plan_json.is_file():
            try:
                old = json.loads(self.plan_json.read_text()).get("fingerprint")
            except (OSError, ValueError):
                old = None
            if old != fingerprint:
                self.unlock()
                raise RunError(
                    f"{self.root} holds results of a different run (plan fingerprint {old} != {fingerprint}); "
                    "use --fresh to replace them or choose another --out"
                )
            return self.log.is_file()
        return False

    def _lock(self) -> None:
        lock = self.root / ".lock"
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            try:
                pid = int(lock.read_text().strip() or 0)
            except (OSError, ValueError):
                pid = 0
            if pid and _alive(pid):
                raise RunError(f"{self.root} is in use by another ablation run (pid {pid})") from None
            lock.unlink(missing_ok=True)
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        os.write(fd, str(os.getpid()).encode())
        os.close(fd)

    def unlock(self) -> None:
        with contextlib.suppress(OSError):
            (self.root / ".lock").unlink()


def _cpu_busy_s() -> float | None:
    """CPU seconds the whole machine has spent busy since boot (Linux ``/proc/stat``), or None elsewhere."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
        user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[1:9])
        return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def _group_stats(pgid: int) -> list[tuple[str, int]] | None:
    """(state letter, CPU ticks used) of every live process of process group ``pgid`` (Linux ``/proc``), or None
    elsewhere. A worker leads its own group, which holds the engine processes it started (``omni``'s ``mp`` worker,
    a ``serve`` server and its engine)."""
    try:
        pids = [d for d in os.listdir("/proc") if d.isdigit()]
    except OSError:
        return None
    out = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
        except OSError:
            continue  # gone meanwhile
        # after the parenthesised command name: state(3) ppid(4) pgrp(5) ... utime(14) stime(15) cutime(16)
        # cstime(17); the c-fields hold reaped children, so a short-lived process of the group still counts
        rest = stat[stat.rfind(")") + 2 :].split()
        try:
            if int(rest[2]) == pgid:
                out.append((rest[0], sum(int(x) for x in rest[11:15])))
        except (IndexError, ValueError):
            continue
    return out


def _group_cpu_s(pgid: int) -> float | None:
    """CPU seconds (user + system) used so far by the live processes of process group ``pgid``: the CPU a
    generation costs wherever in the worker's group it ran. None without ``/proc``."""
    stats = _group_stats(pgid)
    return None if stats is None else sum(t for _, t in stats) / os.sysconf("SC_CLK_TCK")


def williams_orders(n: int) -> list[list[int]]:
    """Orders of ``n`` configurations (a Williams design: a Latin square balanced for first-order carry-over).

    Over all returned orders each index stands at each position equally often and directly follows each other index
    equally often (n orders for even n; for odd n each order and its reverse, 2n). A plain rotation keeps the cyclic
    neighbours fixed: configuration i would always run right after configuration i-1.
    """
    if n <= 1:
        return [list(range(n))]
    first, lo, hi = [0], 1, n - 1
    while len(first) < n:
        first.append(lo)
        lo += 1
        if len(first) < n:
            first.append(hi)
            hi -= 1
    rows = [[(x + i) % n for x in first] for i in range(n)]
    if n % 2:
        rows += [row[::-1] for row in rows]
    return rows


def _load1() -> float | None:
    """The machine's 1-minute load average (to flag runs measured while other work competed for the CPU)."""
    try:
        return os.getloadavg()[0]
    except (OSError, AttributeError):
        return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
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
        with open(tmp, "w") as f:
            for rec in records:
                f.write(json.dumps(rec) + "\n")
        os.replace(tmp, self.path)
        self.records = list(records)

    def add(self, rec: dict[str, Any]) -> dict[str, Any]:
        rec = {"fp": self.fp, "t": time.time(), **rec}
        with open(self.path, "a") as f:
            f.write(json.dumps(rec) + "\n")
            f.flush()
        self.records.append(rec)
        return rec


def select_resumable(plan: Plan, records: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], int]:
    """The records a resume keeps, and how many measurements it drops (units that did not finish)."""
    failed = {r["config"] for r in records if r.get("type") == "failure"}
    samples = set(plan.samples)
    measured: dict[tuple[str, int], set[tuple[int, int]]] = {}
    for r in records:
        if r.get("type") == "sample" and not r.get("warmup"):
            measured.setdefault((r["config"], r["round"]), set()).add((r["prompt"], r["seed"]))
    complete_units = {k for k, v in measured.items() if samples <= v}
    if plan.schedule == "resident":
        live = [c.id for c in plan.configs if c.id not in failed]
        rounds = {r for r in range(plan.workload.repeats) if all((c, r) in complete_units for c in live)}
        keep_unit = {(c.id, r) for c in plan.configs for r in rounds}
    else:
        keep_unit = complete_units
    kept, dropped = [], 0
    for r in records:
        if r.get("type") == "sample":
            unit = (r["config"], r["round"])
            if unit in keep_unit or r["config"] in failed:
                kept.append(r)
            elif not r.get("warmup"):
                dropped += 1
        else:
            kept.append(r)
    return kept, dropped


# ----------------------------------------------------------------------------------------------------------------
# one worker process
# ----------------------------------------------------------------------------------------------------------------
class Worker:
    """A worker process and the thread that reads its events."""

    def __init__(self, config: Config, rnd: int | None, argv: list[str], env: dict[str, str], log_path: Path) -> None:
        self.config = config
        self.round = rnd
        self.events: queue.Queue[dict[str, Any]] = queue.Queue()
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log_path = log_path
        self._log = open(log_path, "a")  # closed in stop()
        self._log.write(f"\n===== {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(argv)} =====\n")
        self._log.flush()
        self.proc = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            env=env,
            text=True,
            bufsize=1,
            start_new_session=True,  # its own process group: we can end it and any engine processes it started
        )
        self.ready: dict[str, Any] | None = None
        self.paused = False
        self.t_start = time.monotonic()
        self._next_id = 0
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if not line.strip():
                continue
            try:
                self.events.put(decode(line))
            except ValueError:
                self.events.put({"event": "garbage", "line": line[:500]})
        self.events.put({"event": "eof"})

    def wait(self, timeout: float, phase: str) -> dict[str, Any]:
        """The next event; raises WorkerFailed on an error, a dead worker or a timeout."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                self.kill()
                raise WorkerFailed(phase, f"no answer within {timeout:.0f} s (worker killed)")
            try:
                ev = self.events.get(timeout=min(left, 1.0))
            except queue.Empty:
                continue
            kind = ev.get("event")
            if kind == "garbage":
                continue
            if kind == "error":
                raise WorkerFailed(ev.get("phase") or phase, ev.get("error") or "error", ev.get("traceback") or "")
            if kind == "eof":
                rc = self._returncode()
                why = f"worker exited with code {rc}"
                if rc is not None and rc < 0:
                    sig = -rc
                    name = signal.Signals(sig).name if sig in signal.Signals._value2member_map_ else str(sig)
                    why = f"worker killed by {name}" + (" (out of memory?)" if sig == signal.SIGKILL else "")
                raise WorkerFailed(phase, why)
            return ev

    def poll_event(self) -> dict[str, Any] | None:
        try:
            return self.events.get_nowait()
        except queue.Empty:
            return None

    def run(self, prompt: int, seed: int, save: str | None, timeout: float) -> dict[str, Any]:
        """One generation. The result gets ``others_cpu``: cores that other processes kept busy meanwhile (machine
        busy time minus the CPU time of the worker's process group, engine processes included, per second of wall
        time), when both are known."""
        g0 = _group_cpu_s(self.proc.pid)
        b0, t0 = _cpu_busy_s(), time.monotonic()
        ev = self._run(prompt, seed, save, timeout)
        b1, t1 = _cpu_busy_s(), time.monotonic()
        g1 = _group_cpu_s(self.proc.pid)
        # the worker's whole group when /proc shows it (engine processes included), else what the worker reported
        own = g1 - g0 if g0 is not None and g1 is not None else None
        if own is None and ev.get("cpu_ms") is not None:
            own = ev["cpu_ms"] / 1e3
        if b0 is not None and b1 is not None and own is not None and t1 > t0:
            ev["others_cpu"] = max(0.0, (b1 - b0 - own) / (t1 - t0))
        return ev

    def _run(self, prompt: int, seed: int, save: str | None, timeout: float) -> dict[str, Any]:
        self._next_id += 1
        cmd = {"cmd": "run", "id": self._next_id, "prompt": prompt, "seed": seed, "save": save}
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.write(json.dumps(cmd) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            pass  # the reader reports how it died
        while True:
            ev = self.wait(timeout, "run")
            if ev.get("event") == "result" and ev.get("id") == self._next_id:
                return ev

    def _returncode(self) -> int | None:
        try:
            return self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            return None

    def pause(self, settle_s: float = 2.0) -> None:
        """Stop the worker's whole process group (the engine processes it started included) until :meth:`resume`,
        and wait (up to ``settle_s``) until /proc shows every process of it stopped: a signal is delivered
        asynchronously, and the next configuration's measurement must not overlap this group's last work."""
        if self.paused or self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGSTOP)
        except (ProcessLookupError, PermissionError):
            return
        self.paused = True
        deadline = time.monotonic() + settle_s
        while time.monotonic() < deadline:
            stats = _group_stats(self.proc.pid)
            if stats is None or all(state in "TtZX" for state, _ in stats):
                return
            time.sleep(0.001)

    def resume(self) -> None:
        if self.paused:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGCONT)
            self.paused = False

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # the group we created for this worker (start_new_session)
        with contextlib.suppress(Exception):
            self.proc.wait(timeout=10)

    def stop(self, grace: float = 30.0) -> None:
        self.resume()  # a stopped group can neither read "exit" nor shut its engine down
        if self.proc.poll() is None:
            with contextlib.suppress(BrokenPipeError, OSError, ValueError):
                assert self.proc.stdin is not None
                self.proc.stdin.write(json.dumps({"cmd": "exit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.stdin.close()
            try:
                self.proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                pass
        # whatever the worker left behind in its group (engine processes) goes too
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(Exception):
            self.proc.wait(timeout=10)
        with contextlib.suppress(Exception):
            self._log.close()

    def log_tail(self, lines: int = 40) -> str:
        with contextlib.suppress(OSError):
            self._log.flush()
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        return ""


def _stop_all(workers: list[Worker]) -> None:
    """Stop workers at the same time (an engine's shutdown can take seconds; one after another adds up)."""
    threads = [threading.Thread(target=w.stop, daemon=True) for w in workers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


# ----------------------------------------------------------------------------------------------------------------
# the run
# ----------------------------------------------------------------------------------------------------------------
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


class _Progress:
    def __init__(self, total: int, enabled: bool) -> None:
        self.bar = None
        if enabled and total:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, unit="step", file=sys.stderr, dynamic_ncols=True, leave=True)

    def step(self, desc: str) -> None:
        if self.bar is not None:
            self.bar.set_description(desc, refresh=False)
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class Runner:
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
        self._has_accelerator: bool | None = None

    # ----- plumbing ----------------------------------------------------------------------------------------
    def _accelerator(self) -> bool:
        if self._has_accelerator is None:
            self._has_accelerator = _accelerator_visible()
        return self._has_accelerator

    def _job(self, c: Config) -> Path:
        wl = self.wl
        job = {
            "protocol": PROTOCOL_VERSION,
            "config": {"id": c.id, "opts": list(c.opts), "spec": c.spec},
            "engine": self.plan.engine,
            "model": wl.model,
            "model_path": self.plan.model_path,
            "dtype": wl.dtype,
            "height": wl.height,
            "width": wl.width,
            "steps": wl.steps,
            "cfg_scale": float(wl.cfg_scale),
            "negative_prompt": wl.negative_prompt,
            "image": wl.image,
            "prompts": list(wl.prompts),
            "max_sequence_length": wl.seq_len(),
            "enforce_eager": wl.enforce_eager,
            "threads": wl.threads,
            "imports": list(self.plan.extra_imports),
        }
        d = self.out.config_dir(c.id)
        d.mkdir(parents=True, exist_ok=True)
        path = d / "job.json"
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
        if self.plan.engine in ("omni", "serve") and not self._accelerator():
            # vLLM-Omni's own engines on a CPU-only machine: the test bed's opt-in CPU runtime, in every process
            # they start (it changes nothing on an accelerator platform, and is not passed there at all).
            from vllm_omni_ascend_opt.testbed.runtime import engine_env

            env = engine_env(env)
        return env

    def _spawn(self, c: Config, rnd: int | None) -> Worker:
        job = self._job(c)
        return Worker(
            c, rnd, [*self.worker_cmd, "--job", str(job)], self._env(c), self.out.config_dir(c.id) / "worker.log"
        )

    def _fail(self, w: Worker | None, c: Config, rnd: int | None, exc: WorkerFailed) -> None:
        tail = w.log_tail() if w is not None else ""
        rc = w.proc.poll() if w is not None else None
        rec = self.store.add(
            {
                "type": "failure",
                "config": c.id,
                "round": rnd,
                "phase": exc.phase,
                "error": exc.error,
                "traceback": exc.tb,
                "returncode": rc,
                "log_tail": tail,
            }
        )
        self.failed[c.id] = rec
        self.say(
            f"configuration {c.id} failed ({exc.phase}): {exc.error}  [log: {self.out.config_dir(c.id)}/worker.log]"
        )
        if w is not None:
            w.kill()

    def _save_stem(self, c: Config, prompt: int, seed: int) -> str | None:
        stem = self.out.image_stem(c.id, prompt, seed)
        if stem.with_suffix(".png").is_file() and (
            self.plan.engine in ("omni", "serve") or stem.with_suffix(".npy").is_file()
        ):
            return None
        return str(stem)

    def _record_sample(
        self, c: Config, rnd: int, prompt: int, seed: int, warmup: bool, ev: dict[str, Any], pid: int | None
    ) -> None:
        self.store.add(
            {
                "type": "sample",
                "config": c.id,
                "round": rnd,
                "prompt": prompt,
                "seed": seed,
                "warmup": warmup,
                "total_ms": ev["total_ms"],
                "stages_ms": ev.get("stages_ms") or {},
                "cpu_ms": ev.get("cpu_ms"),
                "load1": _load1(),
                "others_cpu": ev.get("others_cpu"),
                "sha256": ev.get("sha256"),
                "pid": pid,
            }
        )

    def _await_ready(self, w: Worker, rnd: int | None) -> None:
        ev = w.wait(self.wl.start_timeout_s, "start")
        if ev.get("event") != "ready":
            raise WorkerFailed("start", f"unexpected first event {ev!r}"[:500])
        w.ready = ev
        self.store.add(
            {
                "type": "ready",
                "config": w.config.id,
                "round": rnd,
                "pid": ev.get("pid"),
                "load_s": ev.get("load_s"),
                "env": ev.get("env"),
                "active": ev.get("active"),
            }
        )

    def _warmup(self, w: Worker, rnd: int, prog: _Progress) -> None:
        samples = self.plan.samples
        for i in range(self.wl.warmup):
            p, s = samples[i % len(samples)]
            ev = w.run(p, s, None, self.wl.timeout_s)
            self._record_sample(w.config, rnd, p, s, True, ev, (w.ready or {}).get("pid"))
            prog.step(f"warm-up {w.config.id}")

    # ----- entry point -------------------------------------------------------------------------------------
    def run(self) -> RunData:
        t0 = time.perf_counter()
        fp = self.plan.fingerprint()
        resumed = self.out.prepare(fp, self.fresh)
        try:
            self.out.plan_json.write_text(json.dumps(self.plan.to_dict(), indent=1))
            self.store = Store(self.out.log, fp)
            dropped = 0
            if resumed:
                kept, dropped = select_resumable(self.plan, self.store.load())
                self.store.rewrite(kept)
                for r in kept:
                    if r.get("type") == "failure":
                        self.failed[r["config"]] = r
                done = sum(1 for r in kept if r.get("type") == "sample" and not r.get("warmup"))
                self.say(
                    f"resuming in {self.out.root}: {done} measurement(s) kept, {dropped} from unfinished units "
                    f"dropped, {len(self.failed)} failed configuration(s) kept as failed"
                )
            else:
                self.store.rewrite([])
            interrupted = False
            try:
                if self.plan.schedule == "resident":
                    self._run_resident()
                else:
                    self._run_per_round()
            except KeyboardInterrupt:
                interrupted = True
                self.say("interrupted: what finished is kept in measurements.jsonl; rerun the same command to resume")
            return RunData(
                self.plan, self.out, list(self.store.records), dropped, resumed, interrupted, time.perf_counter() - t0
            )
        finally:
            self.out.unlock()

    def _todo(self) -> dict[tuple[str, int], set[tuple[int, int]]]:
        """(config, round) -> samples still to measure."""
        have: dict[tuple[str, int], set[tuple[int, int]]] = {}
        for r in self.store.records:
            if r.get("type") == "sample" and not r.get("warmup"):
                have.setdefault((r["config"], r["round"]), set()).add((r["prompt"], r["seed"]))
        todo = {}
        for c in self.plan.configs:
            if c.id in self.failed:
                continue
            for rnd in range(self.wl.repeats):
                left = set(self.plan.samples) - have.get((c.id, rnd), set())
                if left:
                    todo[(c.id, rnd)] = left
        return todo

    def _blocks(self) -> list[list[int]]:
        """The rounds split into ``process_sets`` consecutive blocks, each measured by freshly started workers."""
        n, k = self.wl.repeats, max(1, min(self.wl.process_sets, self.wl.repeats))
        bounds = [round(i * n / k) for i in range(k + 1)]
        return [list(range(bounds[i], bounds[i + 1])) for i in range(k)]

    def _run_resident(self) -> None:
        todo = self._todo()
        blocks = [[r for r in b if any(k[1] == r for k in todo)] for b in self._blocks()]
        blocks = [b for b in blocks if b]
        total = 0
        for b in blocks:
            cfgs = {k[0] for k in todo if k[1] in b}
            total += len(cfgs) * (1 + self.wl.warmup) + sum(len(v) for k, v in todo.items() if k[1] in b)
        prog = _Progress(total, self.progress_enabled)
        try:
            for i, b in enumerate(blocks):
                self._resident_block(b, todo, prog, reverse_start=i % 2 == 1)
        finally:
            prog.close()

    def _resident_block(
        self,
        rounds: list[int],
        todo: dict[tuple[str, int], set[tuple[int, int]]],
        prog: _Progress,
        reverse_start: bool = False,
    ) -> None:
        configs = [c for c in self.plan.configs if c.id not in self.failed and any((c.id, r) in todo for r in rounds)]
        if not configs:
            return
        workers: dict[str, Worker] = {}
        starting: list[Worker] = []
        try:
            # start-up: start_jobs at a time; each warms up as soon as it is ready
            # every other block of rounds starts the configurations in reverse order: measured on 2 cores, workers
            # started earlier ran slower all run long (the first two 5-10%), so each configuration gets an early and
            # a late start
            pending = list(reversed(configs)) if reverse_start else list(configs)
            while pending or starting:
                while pending and len(starting) < self.wl.start_jobs:
                    starting.append(self._spawn(pending.pop(0), None))
                for w in list(starting):
                    if not w.events.empty():  # ready, an error, or eof
                        starting.remove(w)
                        try:
                            self._await_ready(w, None)
                            prog.step(f"started {w.config.id}")
                            workers[w.config.id] = w
                            if self.wl.pause_idle:
                                w.pause()
                        except WorkerFailed as exc:
                            self._fail(w, w.config, None, exc)
                            w.stop(0)
                    elif time.monotonic() - w.t_start > self.wl.start_timeout_s:
                        starting.remove(w)
                        self._fail(w, w.config, None, WorkerFailed("start", "not ready in time (worker killed)"))
                        w.stop(0)
                time.sleep(0.05)
            # warm-up once every worker is up, one after another, right before measuring: a worker warmed up as
            # soon as it was ready (while others were still loading) and then left idle through the other starts
            # took its first measured requests up to 70% slower on the 2-core VM
            order = [c for c in configs if c.id in workers]
            for c in order:
                w = workers[c.id]
                try:
                    w.resume()
                    self._warmup(w, rounds[0], prog)
                    if self.wl.pause_idle:
                        w.pause()
                except WorkerFailed as exc:
                    self._fail(w, c, None, exc)
                    w.stop(0)
                    del workers[c.id]
            order = [c for c in order if c.id in workers]
            # measurement: interleaved
            samples = self.plan.samples
            for rnd in rounds:
                for k, (p, s) in enumerate(samples):
                    live = [c for c in order if c.id in workers and c.id not in self.failed]
                    if not live:
                        return
                    rows = williams_orders(len(live))
                    for c in [live[i] for i in rows[(rnd * len(samples) + k) % len(rows)]]:
                        if (p, s) not in todo.get((c.id, rnd), set()):
                            continue
                        w = workers[c.id]
                        try:
                            w.resume()
                            ev = w.run(p, s, self._save_stem(c, p, s), self.wl.timeout_s)
                            if self.wl.pause_idle:
                                w.pause()
                        except WorkerFailed as exc:
                            self._fail(w, c, rnd, exc)
                            w.stop(0)
                            del workers[c.id]
                            continue
                        self._record_sample(c, rnd, p, s, False, ev, (w.ready or {}).get("pid"))
                        prog.step(f"round {rnd + 1}/{self.wl.repeats}")
        except BaseException:
            for w in [*workers.values(), *starting]:
                w.kill()
            raise
        finally:
            _stop_all([*workers.values(), *starting])

    def _run_per_round(self) -> None:
        todo = self._todo()
        total = sum(1 + self.wl.warmup + len(v) for v in todo.values())
        prog = _Progress(total, self.progress_enabled)
        try:
            for rnd in range(self.wl.repeats):
                cfgs = [c for c in self.plan.configs if (c.id, rnd) in todo]
                if not cfgs:
                    continue
                shift = rnd % len(self.plan.configs)
                ordered = self.plan.configs[shift:] + self.plan.configs[:shift]
                for c in [c for c in ordered if c in cfgs]:
                    if c.id in self.failed:
                        continue
                    w = self._spawn(c, rnd)
                    try:
                        self._await_ready(w, rnd)
                        prog.step(f"started {c.id} (round {rnd + 1})")
                        self._warmup(w, rnd, prog)
                        for p, s in self.plan.samples:
                            ev = w.run(p, s, self._save_stem(c, p, s), self.wl.timeout_s)
                            self._record_sample(c, rnd, p, s, False, ev, (w.ready or {}).get("pid"))
                            prog.step(f"round {rnd + 1}/{self.wl.repeats}")
                    except WorkerFailed as exc:
                        self._fail(w, c, rnd, exc)
                    except BaseException:
                        w.kill()
                        raise
                    finally:
                        w.stop()
        finally:
            prog.close()
