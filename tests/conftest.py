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
# the engines, servers and workers the tests start: one thread each (vLLM gives an engine worker one per core
# otherwise), as several run at once beside the test processes on the same cores
os.environ.setdefault("OMP_NUM_THREADS", "1")


#: ``make test`` runs the suite in pytest-xdist workers (``--dist loadgroup``): the module is the unit one worker
#: runs whole (module-scoped servers and engines start once), unless a test names a group shared across modules.
HEAVY_FIRST = ("slow", "multiproc")


def _group(item: pytest.Item) -> str:
    mark = item.get_closest_marker("xdist_group")
    return (mark.args[0] if mark.args else mark.kwargs["name"]) if mark else item.module.__name__


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the groups into the test ids
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Each item in its module's (or named) xdist group; groups holding a ``slow`` test first, then ``multiproc``
    ones, each in collection order: the longest units start first, so no worker is left with one at the end."""
    rank: dict[str, int] = {}
    for item in items:
        group = _group(item)
        if not item.get_closest_marker("xdist_group"):
            item.add_marker(pytest.mark.xdist_group(group))
        heavy = [i for i, m in enumerate(HEAVY_FIRST) if item.get_closest_marker(m)]
        rank[group] = min(rank.get(group, len(HEAVY_FIRST)), *heavy, len(HEAVY_FIRST))
    items.sort(key=lambda item: rank[_group(item)])  # stable: collection order within a rank and a group


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

    # the test processes sharing the cores: xdist's workers, or the mutants the mutation check runs at once
    share = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or os.environ.get("MUTATION_JOBS") or 1)
    torch.set_num_threads(max(1, min(2, (os.cpu_count() or 1) // share)))
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
