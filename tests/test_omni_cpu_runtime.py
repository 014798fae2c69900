"""The test bed's CPU runtime for vLLM-Omni's engines (which run in tests/test_omni_offline.py and test_omni_serve.py)
and the plugin's status line / status file (fast checks)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest

from tests.harness import last_json
from vllm_omni_ascend_opt import _plugin, _report, flags
from vllm_omni_ascend_opt.testbed import runtime as rt_mod


def test_engine_env_opts_in_and_the_cpu_runtime_changes_nothing_on_an_accelerator_platform(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/somewhere")
    env = rt_mod.engine_env()
    assert env["PYTHONPATH"].split(os.pathsep) == [str(rt_mod.SITE_DIR), "/somewhere"]
    assert env[rt_mod.ENV_CPU_RUNTIME] == "1"
    assert rt_mod.engine_env(env)["PYTHONPATH"] == env["PYTHONPATH"]  # idempotent
    assert (rt_mod.SITE_DIR / "sitecustomize.py").is_file()
    assert rt_mod.ENV_CPU_RUNTIME not in os.environ  # nothing leaks into this process
    import vllm_omni.platforms as platforms
    from vllm.platforms.interface import UnspecifiedPlatform
    from vllm_omni.diffusion.attention.backends.sdpa import SDPAImpl

    class NPUOmniPlatform:  # any platform vLLM-Omni resolved other than UnspecifiedOmniPlatform
        device_type = "npu"

    monkeypatch.setattr(platforms, "current_omni_platform", NPUOmniPlatform(), raising=False)
    monkeypatch.setattr(rt_mod, "_ENGINE_APPLIED", [])
    forward, backend = SDPAImpl.forward, UnspecifiedPlatform.dist_backend
    assert rt_mod.apply_engine_cpu_runtime() == []
    assert SDPAImpl.forward is forward and UnspecifiedPlatform.dist_backend == backend
    assert not hasattr(NPUOmniPlatform, "get_device_count") and not hasattr(NPUOmniPlatform, "dist_backend")
    assert rt_mod.engine_cpu_runtime_applied() == []


def _child(code: str, opt_in: bool, plugins: str | None = None) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter with ``engine_env`` (less the CPU-runtime opt-in unless ``opt_in``)."""
    env = rt_mod.engine_env()
    if not opt_in:
        env.pop(rt_mod.ENV_CPU_RUNTIME)
    env.pop("VLLM_PLUGINS", None)
    if plugins:
        env["VLLM_PLUGINS"] = plugins
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)


_PLUGIN_LOADING = (
    "import json\n"
    "from vllm_omni.plugins import load_omni_general_plugins\n"
    "load_omni_general_plugins()\n"
    "from vllm_omni_ascend_opt._state import STATE\n"
    "from vllm_omni_ascend_opt.testbed.runtime import engine_cpu_runtime_applied\n"
    "print(json.dumps({'applied': engine_cpu_runtime_applied(), 'registered': STATE.registered}))\n"
)


@pytest.mark.parametrize(
    ("opt_in", "plugins"), [(True, None), (True, "some_other_plugin"), (False, None), (False, "some_other_plugin")]
)
def test_plugin_loading_applies_the_cpu_runtime_only_when_asked(opt_in, plugins):
    """The runtime applies when asked, whether or not ours is a plugin; ours registers unless left out."""
    out = last_json(_child(_PLUGIN_LOADING, opt_in, plugins))
    assert out["registered"] is (plugins is None)  # the plugin's part is independent of the runtime
    if not opt_in:
        assert out["applied"] == []
        return
    assert "attention->SDPA" in out["applied"] and "platform methods" in out["applied"]


_PROBE = (
    "import importlib, json\n"
    "out = {}\n"
    "m = importlib.import_module('transformers.models.qwen2_vl.image_processing_qwen2_vl')\n"
    "out['smart_resize'] = callable(getattr(m, 'smart_resize', None))\n"
    "out['twin'] = getattr(m, '__ascend_opt_cpu_twin__', None)\n"
    "try:\n"
    "    import torchaudio\n"
    "    out['torchaudio'] = torchaudio.__version__\n"
    "except ImportError:\n"
    "    out['torchaudio'] = None\n"
    "print(json.dumps(out))\n"
)


@pytest.mark.parametrize("opt_in", [True, False])
def test_sitecustomize_serves_missing_imports_only_when_asked(opt_in):
    import importlib.util

    if importlib.util.find_spec("torchvision") is not None or importlib.util.find_spec("torchaudio") is not None:
        pytest.skip("torchvision / torchaudio are installed here: nothing to serve")
    proc = _child(_PROBE, opt_in)
    if opt_in:
        out = last_json(proc)
        assert out["smart_resize"] and out["twin"].endswith("image_processing_pil_qwen2_vl")
        assert out["torchaudio"] == "0+ascend-opt-cpu-placeholder"
    else:
        assert proc.returncode != 0 and "torchvision" in proc.stderr  # the failure the runtime exists for


def test_one_status_line_per_process_with_what_is_off_and_the_status_file(monkeypatch, caplog, tmp_path, tiny_pipe):
    monkeypatch.setenv(flags.ENV_FLAG, "none,+rope")
    with caplog.at_level(logging.INFO, logger=_report.LOGGER_NAME):
        _plugin.register()
        _plugin.install_ready()
        _report.announce()
    lines = [r for r in caplog.records if "vllm-omni-ascend-opt 0.1.0" in r.getMessage()]
    assert len(lines) == 1 and lines[0].levelno == logging.INFO
    msg = lines[0].getMessage()
    assert "(VLLM_OMNI_ASCEND_OPT=none,+rope)" in msg
    if _report.pending():
        pytest.fail("rope's module is imported in this process; nothing should be pending")
    assert "installed rope; off: shared_modulation (not selected by VLLM_OMNI_ASCEND_OPT)" in msg
    from vllm_omni_ascend_opt import api

    path = tmp_path / "status-{pid}.json"
    monkeypatch.setenv(_report.ENV_STATUS_FILE, str(path))
    api.select("none,+rope,+shared_modulation", model=tiny_pipe)
    written = _report.write_status_file(tiny_pipe)
    assert written == tmp_path / f"status-{os.getpid()}.json"
    st = json.loads(written.read_text())
    assert st["pid"] == os.getpid() and st["installed"] == ["shared_modulation", "rope"]
    assert st["acting_on_pipeline"] == ["shared_modulation", "rope"] and st["pipeline"] == "QwenImagePipeline"
    assert st["off"]["vae_exact"] == "not selected by VLLM_OMNI_ASCEND_OPT"
    mem = st["memory"]
    assert mem["shared_modulation"]["budget_bytes"] == 512 * 1024**2 and mem["rope"]["table_cap"] > 0
