"""Shared fixtures. vLLM-Omni is imported once per test session (it costs 8-16 s per process)."""

from __future__ import annotations

import functools
import gc
import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # "tests.fake_torch_npu" importable
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_collection_finish(session: pytest.Session) -> None:
    """Freeze what collection imported (never garbage): the collector's full passes then scan only what tests create."""
    gc.collect()
    gc.freeze()


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    from vllm_omni_ascend_opt.testbed import build_model_dir

    return build_model_dir()


@pytest.fixture(scope="session")
def runtime(tiny_model_dir):
    """vLLM-Omni's configs and (world size 1, gloo) process groups for this test process."""
    import torch

    from vllm_omni_ascend_opt.testbed.runtime import init_cpu_runtime

    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    return init_cpu_runtime(str(tiny_model_dir))


@pytest.fixture(scope="session")
def tiny_pipe(runtime):
    """The tiny Qwen-Image loaded through vLLM-Omni's own loader, with no optimization attached."""
    from vllm_omni_ascend_opt import _plugin
    from vllm_omni_ascend_opt.testbed.pipeline import load_pipeline

    _plugin._reset_for_tests()
    return load_pipeline(runtime)


@pytest.fixture(scope="module")
def bf16_transformer(runtime, tiny_pipe):
    """A second QwenImageTransformer2DModel with the tiny weights in bfloat16 (the session pipeline stays fp32)."""
    import torch

    from vllm_omni_ascend_opt.blocks.upstream import targets
    from vllm_omni_ascend_opt.testbed.tiny_model import TINY

    mod = sys.modules[targets.TRANSFORMER]
    with runtime.context():
        t = mod.QwenImageTransformer2DModel(od_config=runtime.od_config, **TINY.transformer_kwargs())
    t.load_state_dict(tiny_pipe.transformer.state_dict())
    return t.to(torch.bfloat16).eval()


@pytest.fixture(autouse=True)
def _fresh_plugin_state(monkeypatch, tmp_path_factory):
    """Nothing selected or installed before and after each test, and a saved-verdict cache of its own per test."""
    from vllm_omni_ascend_opt import _backend, _plugin
    from vllm_omni_ascend_opt.blocks.kernels import saved

    monkeypatch.setenv(saved.ENV_VERDICT_CACHE, str(tmp_path_factory.mktemp("verdicts")))
    saved.forget()
    _plugin._reset_for_tests()
    _backend.reset_cache()
    yield
    _plugin._reset_for_tests()
    _backend.reset_cache()


@pytest.fixture
def fake_npu(monkeypatch):
    """Factory: ``fake_npu(rotary="half_pairing", ...)`` installs the semantic torch_npu fake for one test."""
    from tests.fake_torch_npu import install

    return functools.partial(install, monkeypatch)
