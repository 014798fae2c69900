"""The runner's side of a worker process: started as the leader of its own process group (which holds the engine
processes it starts), driven over the line protocol, and paused, continued, stopped or killed as one group. The CPU a
generation costs is accounted for the whole group from Linux ``/proc``; the machine's busy time minus the group's is
what other processes took meanwhile (``others_cpu``).
"""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

from vllm_omni_ascend_opt.ablation.plan import Config
from vllm_omni_ascend_opt.ablation.worker import decode, send


class WorkerFailed(RuntimeError):
    """A worker reported an error, died, or did not answer in time (``phase``: start or run)."""

    def __init__(self, phase: str, error: str, tb: str = "") -> None:
        super().__init__(error)
        self.phase, self.error, self.tb = phase, error, tb


def cpu_busy_s() -> float | None:
    """CPU seconds the whole machine has spent busy since boot (Linux ``/proc/stat``), or None elsewhere."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
        user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[1:9])
        return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def group_stats(pgid: int) -> list[tuple[str, int]] | None:
    """(state letter, CPU ticks) of every live process of group ``pgid`` (Linux ``/proc``; None elsewhere)."""
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


def group_cpu_s(pgid: int) -> float | None:
    """CPU seconds (user + system) used so far by process group ``pgid``; None without ``/proc``."""
    stats = group_stats(pgid)
    return None if stats is None else sum(t for _, t in stats) / os.sysconf("SC_CLK_TCK")


def load1() -> float | None:
    """The machine's 1-minute load average (to flag runs measured while other work competed for the CPU)."""
    with contextlib.suppress(OSError, AttributeError):
        return os.getloadavg()[0]
    return None


class Worker:
    """A worker process and the thread that reads its events."""

    def __init__(self, config: Config, argv: list[str], env: dict[str, str], log_path: Path) -> None:
        self.config = config
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
                rc = None
                with contextlib.suppress(subprocess.TimeoutExpired):
                    rc = self.proc.wait(timeout=10)
                why = f"worker exited with code {rc}"
                if rc is not None and rc < 0:
                    sig = -rc
                    name = signal.Signals(sig).name if sig in signal.Signals._value2member_map_ else str(sig)
                    why = f"worker killed by {name}" + (" (out of memory?)" if sig == signal.SIGKILL else "")
                raise WorkerFailed(phase, why)
            return ev

    def wait_ready(self, timeout: float) -> dict[str, Any]:
        """The worker's ``ready`` event (kept in :attr:`ready`); raises WorkerFailed on anything else."""
        ev = self.wait(timeout, "start")
        if ev.get("event") != "ready":
            raise WorkerFailed("start", f"unexpected first event {ev!r}"[:500])
        self.ready = ev
        return ev

    def run(self, prompt: int, seed: int, save: str | None, timeout: float) -> dict[str, Any]:
        """One generation, with ``others_cpu``: the cores other processes kept busy meanwhile, when known."""
        self._next_id += 1
        cmd = {"cmd": "run", "id": self._next_id, "prompt": prompt, "seed": seed, "save": save}
        g0 = group_cpu_s(self.proc.pid)
        b0, t0 = cpu_busy_s(), time.monotonic()
        with contextlib.suppress(BrokenPipeError, OSError):  # the reader reports how it died
            assert self.proc.stdin is not None
            send(self.proc.stdin, cmd)
        ev = self.wait(timeout, "run")
        while ev.get("event") != "result" or ev.get("id") != self._next_id:
            ev = self.wait(timeout, "run")
        b1, t1 = cpu_busy_s(), time.monotonic()
        g1 = group_cpu_s(self.proc.pid)
        # the worker's whole group when /proc shows it (engine processes included), else what the worker reported
        own = g1 - g0 if g0 is not None and g1 is not None else None
        if own is None and ev.get("cpu_ms") is not None:
            own = ev["cpu_ms"] / 1e3
        if b0 is not None and b1 is not None and own is not None and t1 > t0:
            ev["others_cpu"] = max(0.0, (b1 - b0 - own) / (t1 - t0))
        return ev

    def pause(self, settle_s: float = 2.0) -> None:
        """Stop the worker's group until :meth:`resume`; wait until it is stopped, so the next measurement is alone."""
        if self.paused or self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGSTOP)
        except (ProcessLookupError, PermissionError):
            return
        self.paused = True
        deadline = time.monotonic() + settle_s
        while time.monotonic() < deadline:
            stats = group_stats(self.proc.pid)
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
                send(self.proc.stdin, {"cmd": "exit"})
                self.proc.stdin.close()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=grace)
        self.kill()  # whatever the worker left behind in its group (engine processes) goes too
        with contextlib.suppress(Exception):
            self._log.close()

    def log_tail(self, lines: int = 40) -> str:
        with contextlib.suppress(OSError):
            self._log.flush()
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        return ""


def stop_all(workers: list[Worker]) -> None:
    """Stop workers at the same time (an engine's shutdown can take seconds; one after another adds up)."""
    threads = [threading.Thread(target=w.stop, daemon=True) for w in workers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
