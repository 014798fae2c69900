"""The ablation ``serve`` engine without a server (real one: tests/test_omni_serve.py): flags and the CPU runtime
reach the server's environment, and an answer becomes a ``Generation``."""

from __future__ import annotations

import base64
import io
import json

import numpy as np
import pytest

from vllm_omni_ascend_opt.ablation import engines as engines_mod
from vllm_omni_ascend_opt.testbed import serve as serve_mod
from vllm_omni_ascend_opt.testbed.runtime import ENV_CPU_RUNTIME, SITE_DIR

JOB = {
    "config": {"id": "loo_rope", "opts": ["shared_modulation", "vae_exact"], "spec": "none,+shared_modulation"},
    "model": "tiny",
    "model_path": "/models/tiny",
    "dtype": "float32",
    "enforce_eager": True,
    "height": 32,
    "width": 48,
    "steps": 4,
    "cfg_scale": 3.0,
    "negative_prompt": "dark",
    "max_sequence_length": 64,
}


@pytest.fixture
def engine_env(monkeypatch, tmp_path):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setenv("VLLM_OMNI_ASCEND_OPT_STATUS_FILE", "")  # the engine sets it; restored after the test


def _png(arr: np.ndarray) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return buf.getvalue()


def test_server_gets_the_flags_and_the_cpu_runtime_and_its_answer_becomes_a_generation(monkeypatch, engine_env):
    monkeypatch.setenv("VLLM_OMNI_ASCEND_OPT", "none,+shared_modulation")
    monkeypatch.setenv("VLLM_OMNI_ASCEND_OPT_STRICT", "1")
    calls = []

    class Popen:
        pid, returncode = 999999, None

        def __init__(self, argv, **kwargs):
            calls.append((argv, kwargs))

        def poll(self):
            return None

    monkeypatch.setattr(serve_mod.subprocess, "Popen", Popen)
    monkeypatch.setattr(serve_mod.OmniServer, "wait_ready", lambda self, timeout=0: self)
    eng = engines_mod.ServeEngine(JOB)
    eng.load()
    (argv, kw) = calls[0]
    assert argv[1:4] == ["serve", "/models/tiny", "--omni"]
    assert argv[argv.index("--host") + 1] == "127.0.0.1" and "--enforce-eager" in argv
    assert "--distributed-executor-backend" not in argv  # vLLM-Omni's default executor, as users run it
    assert "--enable-diffusion-pipeline-profiler" in argv  # per-stage durations in every response
    env = kw["env"]
    assert env["VLLM_OMNI_ASCEND_OPT"] == "none,+shared_modulation" and env["VLLM_OMNI_ASCEND_OPT_STRICT"] == "1"
    assert env[ENV_CPU_RUNTIME] == "1" and env["PYTHONPATH"].split(":")[0] == str(SITE_DIR)
    assert env["VLLM_OMNI_ASCEND_OPT_STATUS_FILE"] == str(eng.status_path)
    assert kw["start_new_session"] is False  # in the worker's group: the runner's group kill ends it too
    pixels = np.arange(32 * 48 * 3, dtype=np.uint8).reshape(32, 48, 3)
    sent = {}

    class FakeServer:
        def generate(self, body, timeout):
            sent.update(body)
            payload = {
                "data": [{"b64_json": base64.b64encode(_png(pixels)).decode()}],
                "metrics": {
                    "stage_durations": {
                        "QwenImagePipeline.diffuse": 0.5,
                        "QwenImagePipeline.vae.decode": 0.1,
                        "stage_0_gen_ms": 640.0,
                        "queue_wait_ms": 2.0,
                    }
                },
            }
            return serve_mod.ImageResponse(200, payload, 0.75, _png(pixels))

    eng = engines_mod.ServeEngine(JOB)
    eng.server = FakeServer()
    gen = eng.generate("a cat", 7)
    assert sent["size"] == "48x32" and sent["seed"] == 7 and sent["num_inference_steps"] == 4
    assert sent["true_cfg_scale"] == 3.0 and sent["negative_prompt"] == "dark" and sent["response_format"] == "b64_json"
    assert np.array_equal(gen.uint8, pixels) and gen.float_chw is None
    assert gen.total_ms == pytest.approx(750.0)
    assert gen.stages_ms == pytest.approx({"denoise": 500.0, "vae_decode": 100.0, "server_generate": 640.0})
    eng = engines_mod.ServeEngine(JOB)
    with pytest.raises(RuntimeError, match="no plugin status file"):
        eng.active()
    eng.status_path.write_text(
        json.dumps({"pid": 5, "acting_on_pipeline": ["shared_modulation"], "off": {"vae_exact": "not selected"}})
    )
    assert eng.active() == ["shared_modulation"]
    assert eng.model_reasons("vae_exact") == ["in the engine process 5: not selected"]


@pytest.mark.parametrize("engine", ["testbed", "omni", "serve"])
def test_runner_passes_the_cpu_runtime_to_vllm_omni_engines_only(monkeypatch, tmp_path, engine):
    from vllm_omni_ascend_opt.ablation import runner as runner_mod
    from vllm_omni_ascend_opt.ablation.plan import build_plan, opt_infos_from_registry
    from vllm_omni_ascend_opt.ablation.workload import load_workload

    monkeypatch.delenv(ENV_CPU_RUNTIME, raising=False)
    monkeypatch.setattr(runner_mod, "accelerator_visible", lambda: False)
    plan = build_plan(load_workload("tiny-cpu"), opt_infos_from_registry(), engine=engine)
    r = runner_mod.Runner(plan, tmp_path / "out", progress=False)
    full = plan.config("full")
    env = r._env(full)
    assert env["VLLM_OMNI_ASCEND_OPT"] == full.spec and env["VLLM_OMNI_ASCEND_OPT_STRICT"] == "1"
    if engine == "testbed":
        assert ENV_CPU_RUNTIME not in env  # the test-bed engine sets up its own runtime in-process
    else:
        assert env[ENV_CPU_RUNTIME] == "1" and env["PYTHONPATH"].split(":")[0] == str(SITE_DIR)
    monkeypatch.setattr(runner_mod, "accelerator_visible", lambda: True)
    r2 = runner_mod.Runner(plan, tmp_path / "out2", progress=False)
    assert ENV_CPU_RUNTIME not in r2._env(full)  # never passed to an accelerator machine's engines
