"""The ablation run's output directory: its layout, its lock, the measurement log (tagged with the plan's
fingerprint) and what a resume keeps (:func:`select_resumable`); docs/ablation.md, "Robustness".
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

from vllm_omni_ascend_opt.ablation.plan import Plan

#: Files and folders the runner owns inside --out (``--fresh`` removes exactly these).
OWNED = ("plan.json", "measurements.jsonl", "results.json", "report.md", "ablation.png", "configs", "images", ".lock")

#: (configuration id, round) -> the (prompt, seed) samples measured for it.
Measured = dict[tuple[str, int], set[tuple[int, int]]]


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


def measured(records: list[dict[str, Any]]) -> Measured:
    """The measured (not warm-up) samples in ``records``, per (configuration, round)."""
    out: Measured = {}
    for r in records:
        if r.get("type") == "sample" and not r.get("warmup"):
            out.setdefault((r["config"], r["round"]), set()).add((r["prompt"], r["seed"]))
    return out


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
