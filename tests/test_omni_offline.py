"""The plugin inside vLLM-Omni's offline engine ``Omni`` on CPU with the tiny model, three engines side by side: the
default stack built in an mp worker (through the entry points) must give ``none``'s images bitwise, and an engine
whose ``VLLM_PLUGINS`` names another plugin must not load ours and still serve stock images.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.harness import REPO, last_json, run_python
from vllm_omni_ascend_opt.testbed.runtime import engine_env

pytestmark = [pytest.mark.slow, pytest.mark.multiproc]

SCRIPT = Path(__file__).with_name("omni_offline_script.py")
NPU_FREE_DEFAULT = {"shared_modulation", "rope", "joint_attention", "vae_exact"}  # the default stack minus torch_npu's
#: The plugin's INFO line starts with this (one per process that loaded it).
PLUGIN_LINE = "vllm-omni-ascend-opt 0.1.0 (VLLM_OMNI_ASCEND_OPT="
#: The test bed's CPU runtime logs this where it applied itself (testbed/runtime.py).
RUNTIME_LINE = "CPU runtime for vLLM-Omni's engines"


def _start(model: Path, out: Path, flag: str, kwargs: dict, plugins: str | None = None) -> subprocess.Popen:
    out.mkdir(parents=True, exist_ok=True)
    env = engine_env()
    env.pop("VLLM_PLUGINS", None)
    if plugins is not None:
        env["VLLM_PLUGINS"] = plugins  # vLLM-Omni loads only the general plugins named here
    env.update(
        VLLM_OMNI_ASCEND_OPT=flag,
        VLLM_OMNI_ASCEND_OPT_STATUS_FILE=str(out / "status.json"),
        VLLM_LOGGING_COLOR="0",
        PYTHONPATH=os.pathsep.join([env["PYTHONPATH"], str(REPO)]),
    )
    with open(out / "log.txt", "wb") as log:  # the child keeps its own descriptor
        return subprocess.Popen(
            [sys.executable, str(SCRIPT), str(model), str(out), json.dumps(kwargs)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )


@pytest.fixture(scope="module")
def runs(tiny_model_dir, tmp_path_factory):
    """The output directory of each engine (run concurrently, killed by process group at the end)."""
    root = tmp_path_factory.mktemp("omni_offline")
    mp = {"distributed_executor_backend": "mp"}
    procs = {
        "default": _start(tiny_model_dir, root / "default", "default", mp),
        "none": _start(tiny_model_dir, root / "none", "none", {}),
        "other_plugin": _start(tiny_model_dir, root / "other_plugin", "default", mp, plugins="some_other_plugin"),
    }
    try:
        for name, proc in procs.items():
            rc = proc.wait(timeout=400)
            log = (root / name / "log.txt").read_text(errors="replace")
            assert rc == 0, f"Omni run '{name}' failed ({rc}):\n" + "\n".join(log.splitlines()[-60:])
        yield {name: root / name for name in procs}
    finally:
        for proc in procs.values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, 9)
            proc.wait(timeout=10)


def _read(out: Path) -> tuple[dict, dict, str]:
    """An engine's status file, result file (absent: ``{}``) and log."""
    status, result = (
        json.loads(p.read_text()) if p.exists() else {} for p in (out / "status.json", out / "result.json")
    )
    return status, result, (out / "log.txt").read_text(errors="replace")


def _assert_images_equal_none(runs: dict[str, Path], name: str) -> None:
    files = sorted(p.name for p in runs[name].glob("*.npy"))
    assert files == ["0.npy", "1.npy"] == sorted(p.name for p in runs["none"].glob("*.npy"))
    for f in files:
        a, b = np.load(runs[name] / f), np.load(runs["none"] / f)
        assert a.shape == b.shape and a.shape[-1] == 3
        assert a.std() > 0, "a constant image would make the comparison vacuous"
        assert np.array_equal(a, b), f"{name} {f}: differs from VLLM_OMNI_ASCEND_OPT=none"


def _runtime_applied_in_the_worker(log: str) -> bool:
    return any(RUNTIME_LINE in ln and "DiffusionWorker" in ln for ln in log.splitlines())


def test_default_stack_in_the_mp_worker_is_bitwise_none_and_none_installs_nothing(runs):
    status, result, log = _read(runs["default"])
    assert status["pid"] not in (os.getpid(), result["pid"]), "the model must be built in the mp worker process"
    assert status["pipeline"] == "QwenImagePipeline"
    assert NPU_FREE_DEFAULT <= set(status["installed"]), status
    assert NPU_FREE_DEFAULT <= set(status["acting_on_pipeline"]), status
    assert "torch_npu" in status["off"]["fused_attention"]
    assert _runtime_applied_in_the_worker(log), "the test bed's CPU runtime must have been applied in the worker"
    assert status["requests"] >= len(list(runs["default"].glob("*.npy")))  # refreshed after every forward
    lines = [ln for ln in log.splitlines() if PLUGIN_LINE + "default)" in ln]
    worker = [ln for ln in lines if "DiffusionWorker" in ln]
    assert len(worker) == 1, lines  # one INFO line per process, the worker's tagged by vLLM
    assert " INFO " in worker[0] and "installed shared_modulation, rope, vae_exact, joint_attention" in worker[0]
    assert "fused_attention (torch_npu" in worker[0]
    _assert_images_equal_none(runs, "default")
    status, result, _ = _read(runs["none"])
    assert status["pid"] == result["pid"], "without the mp backend the model is built in the Omni process"
    assert status["installed"] == [] and status["acting_on_pipeline"] == []


def test_engine_without_our_plugin_starts_and_serves_stock(runs):
    """``VLLM_PLUGINS`` without ours: the engine starts, serves ``none``'s images, no process loads ours."""
    _, _, log = _read(runs["other_plugin"])
    assert not (runs["other_plugin"] / "status.json").exists(), (
        "the plugin was loaded although VLLM_PLUGINS excludes it"
    )
    assert (runs["default"] / "status.json").is_file()  # the same status-file setting works where it is loaded
    assert not [ln for ln in log.splitlines() if PLUGIN_LINE in ln]
    assert _runtime_applied_in_the_worker(log), "the test bed's CPU runtime must have been applied in the mp worker"
    _assert_images_equal_none(runs, "other_plugin")


def test_register_without_the_opt_in_applies_no_cpu_runtime():
    """vLLM-Omni loading the plugin in a plain process: no test-bed import, vLLM-Omni's platform untouched."""
    code = (
        "import sys, json\n"
        "from vllm_omni.plugins import load_omni_general_plugins\n"
        "load_omni_general_plugins()\n"
        "from vllm_omni.platforms import current_omni_platform as p\n"
        "from vllm_omni_ascend_opt import _state\n"
        "print(json.dumps({'registered': _state.STATE.registered,"
        " 'testbed': 'vllm_omni_ascend_opt.testbed.runtime' in sys.modules,"
        " 'dist_backend': type(p).dist_backend, 'routed': bool(getattr(type(p), '_ascend_opt_cpu_routed', False))}))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "VLLM_OMNI_ASCEND_OPT_CPU_RUNTIME"}
    result = last_json(run_python(code, env, timeout=300, VLLM_LOGGING_COLOR="0", VLLM_OMNI_ASCEND_OPT="default"))
    assert result == {"registered": True, "testbed": False, "dist_backend": "", "routed": False}
