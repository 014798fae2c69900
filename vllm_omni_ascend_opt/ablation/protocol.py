"""The line protocol between the ablation runner (parent) and its worker processes: one JSON object per line.

The parent sends commands on the worker's stdin and reads events from its stdout (anything else the worker prints
goes to stderr, the configuration's log). worker -> parent::

    {"event": "ready", "protocol": 1, "pid": 123, "load_s": 4.2, "env": {...}, "active": [...] | null, "memory": ...}
    {"event": "result", "id": 7, "total_ms": 61.2, "stages_ms": {...}, "cpu_ms": 60.8 | null, "sha256": "...",
     "saved": true}
    {"event": "error", "id": 7 | null, "phase": "start" | "run", "error": "...", "traceback": "..."}
    {"event": "bye"}

parent -> worker: ``{"cmd": "run", "id": 7, "prompt": 0, "seed": 42, "save": "/out/images/full/p0_s42" | null}``,
``{"cmd": "exit"}``. After an ``error`` the parent records the configuration as failed.
"""

from __future__ import annotations

import json
from typing import IO, Any

from vllm_omni_ascend_opt.optimization import STAGES

PROTOCOL_VERSION = 1
__all__ = ["PROTOCOL_VERSION", "STAGES", "decode", "send"]


def send(stream: IO[str], obj: dict[str, Any]) -> None:
    stream.write(json.dumps(obj, separators=(",", ":")) + "\n")
    stream.flush()


def decode(line: str) -> dict[str, Any]:
    obj = json.loads(line)
    if not isinstance(obj, dict):
        raise ValueError(f"protocol message is not an object: {line[:200]!r}")
    return obj
