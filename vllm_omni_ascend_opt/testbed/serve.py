"""``vllm serve <model> --omni`` as a child process on 127.0.0.1 leading its own process group (:meth:`OmniServer.stop`
ends all it started), and a standard-library HTTP client for it."""

from __future__ import annotations

import base64
import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm_omni_ascend_opt.testbed.runtime import engine_env, free_port

HOST = "127.0.0.1"


class ServerError(RuntimeError):
    """The server exited or did not become healthy in time (the message holds the end of its output)."""


@dataclass
class ImageResponse:
    status: int
    body: dict[str, Any]
    latency_s: float
    png: bytes | None = None

    def image(self) -> Any:
        """The first image as a uint8 numpy array [H, W, 3]."""
        import numpy as np
        from PIL import Image

        if self.png is None:
            raise ValueError(f"no image in the response (HTTP {self.status}): {json.dumps(self.body)[:500]}")
        return np.asarray(Image.open(io.BytesIO(self.png)).convert("RGB"), dtype=np.uint8)

    def stage_durations(self) -> dict[str, float]:
        return dict((self.body.get("metrics") or {}).get("stage_durations") or {})


def image_request(
    prompt: str,
    *,
    width: int,
    height: int,
    steps: int,
    seed: int,
    cfg_scale: float = 1.0,
    negative_prompt: str | None = None,
) -> dict[str, Any]:
    """An OpenAI images-API body for vLLM-Omni's server (``true_cfg_scale`` > 1 with a negative prompt: true CFG)."""
    body: dict[str, Any] = {
        "prompt": prompt,
        "size": f"{width}x{height}",
        "n": 1,
        "seed": seed,
        "num_inference_steps": steps,
        "true_cfg_scale": float(cfg_scale),
        "response_format": "b64_json",
    }
    if cfg_scale > 1.0:
        body["negative_prompt"] = negative_prompt if negative_prompt is not None else " "
    return body


@dataclass
class OmniServer:
    """One server on a free port, in this environment plus ``env`` and :func:`engine_env`'s, logging to ``log_path``
    (None: stderr); ``new_session=False`` keeps it in the caller's process group."""

    model: str
    log_path: Path | None
    env: dict[str, str] = field(default_factory=dict)
    mp: bool = True
    dtype: str = "float32"
    enforce_eager: bool = True
    new_session: bool = True
    extra_args: list[str] = field(default_factory=list)
    port: int = 0
    proc: subprocess.Popen | None = None
    model_id: str | None = None

    @property
    def base_url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def start(self) -> OmniServer:
        self.port = self.port or free_port()
        script = Path(sys.executable).with_name("vllm")  # this environment's console script, else ``python -m``
        cli = [str(script)] if script.is_file() else [sys.executable, "-m", "vllm.entrypoints.cli.main"]
        argv = [
            *cli,
            "serve",
            self.model,
            "--omni",
            "--host",
            HOST,
            "--port",
            str(self.port),
            "--dtype",
            self.dtype,
            *(["--enforce-eager"] if self.enforce_eager else []),
            *(["--distributed-executor-backend", "mp"] if self.mp else []),
            *self.extra_args,
        ]
        env = engine_env({**os.environ, **self.env})
        env.setdefault("VLLM_LOGGING_COLOR", "0")
        env["PYTHONUNBUFFERED"] = "1"
        header = f"===== {time.strftime('%H:%M:%S')} {' '.join(argv)}\n"
        if self.log_path is not None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") if self.log_path else contextlib.nullcontext() as log:
            out = log.fileno() if log else sys.stderr.fileno()
            os.write(out, header.encode())
            self.proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=self.new_session,
            )
        return self

    def wait_ready(self, timeout: float = 240.0) -> OmniServer:
        """Poll ``/health`` until 200; raise :class:`ServerError` when the server exits or the time is up."""
        assert self.proc is not None, "start() first"
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise ServerError(f"server exited with code {self.proc.returncode}:\n{self.log_tail()}".rstrip())
            if self.healthy(timeout=2):
                break
            if time.monotonic() > deadline:
                raise ServerError(f"server not healthy within {timeout:.0f} s:\n{self.log_tail()}")
            time.sleep(0.5)
        with urllib.request.urlopen(self.base_url + "/v1/models", timeout=10) as r:
            self.model_id = json.load(r)["data"][0]["id"]
        return self

    def wait_exit(self, timeout: float) -> int | None:
        assert self.proc is not None
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    def healthy(self, timeout: float = 5.0) -> bool:
        try:
            with urllib.request.urlopen(self.base_url + "/health", timeout=timeout) as r:
                return r.status == 200
        except (OSError, urllib.error.URLError):
            return False

    def generate(self, body: dict[str, Any], timeout: float = 120.0) -> ImageResponse:
        body = dict(body)
        if self.model_id is not None:
            body.setdefault("model", self.model_id)
        url, headers = self.base_url + "/v1/images/generations", {"Content-Type": "application/json"}
        req = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers, method="POST")
        t0 = time.perf_counter()
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                status, payload = r.status, json.loads(r.read() or b"{}")
        except urllib.error.HTTPError as exc:
            raw = exc.read()
            try:
                status, payload = exc.code, json.loads(raw or b"{}")
            except ValueError:
                status, payload = exc.code, {"raw": raw.decode(errors="replace")[:2000]}
        latency = time.perf_counter() - t0
        data = payload.get("data") if status == 200 else None
        return ImageResponse(status, payload, latency, base64.b64decode(data[0]["b64_json"]) if data else None)

    def log_text(self) -> str:
        if self.log_path is not None:
            with contextlib.suppress(OSError):
                return self.log_path.read_text(errors="replace")
        return ""

    def log_tail(self, lines: int = 60) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    def group_alive(self) -> bool:
        """Whether any process of the server's group (without a session of its own: the server) is still there."""
        if self.proc is None:
            return False
        if not self.new_session:
            return self.proc.poll() is None
        try:
            with contextlib.suppress(PermissionError):  # there, owned by another user
                os.killpg(self.proc.pid, 0)
        except ProcessLookupError:
            return False
        return True

    def stop(self, grace: float = 20.0) -> None:
        """SIGTERM to the server's process group, then SIGKILL to whatever is left of it; reap the server."""
        if self.proc is None:
            return
        self._signal(signal.SIGTERM)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and self.group_alive():
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=0.2)
        self._signal(signal.SIGKILL)
        with contextlib.suppress(Exception):
            self.proc.wait(timeout=10)
        end = time.monotonic() + 10
        while self.group_alive() and time.monotonic() < end:  # zombies of the group are reaped by init
            time.sleep(0.1)

    def _signal(self, sig: int) -> None:
        """``sig`` to the server's process group (its pid, with ``new_session``), else to the server alone."""
        assert self.proc is not None
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if self.new_session:
                os.killpg(self.proc.pid, sig)
            else:
                self.proc.send_signal(sig)


def stop_all(servers: list[OmniServer], grace: float = 20.0) -> None:
    """Stop several servers at the same time (each as :meth:`OmniServer.stop`)."""
    threads = [threading.Thread(target=srv.stop, args=(grace,), daemon=True) for srv in servers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
