"""``_parallel``: which vLLM-Omni parallel modes a model runs in, and the reasons an optimization is off there."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from vllm_omni_ascend_opt import _parallel, optimization, registry

FIELDS = "ulysses_degree ring_degree allgather_degree cfg_parallel_size tensor_parallel_size vae_patch_parallel_size"


def _pc(**kw):
    return SimpleNamespace(**{**dict.fromkeys(FIELDS.split(), 1), **kw})


@pytest.mark.parametrize(
    ("fields", "modes"),
    [
        ({}, ["single"]),
        ({"ulysses_degree": 2}, ["ulysses"]),
        ({"ring_degree": 2}, ["ring"]),
        ({"cfg_parallel_size": 2}, ["cfg_parallel"]),
        ({"tensor_parallel_size": 2}, ["tensor_parallel"]),
        ({"ulysses_degree": 2, "cfg_parallel_size": 2}, ["ulysses", "cfg_parallel"]),
        ({"vae_patch_parallel_size": 2}, ["vae_patch_parallel"]),
    ],
)
def test_active_modes_from_a_pipeline_or_its_transformer(fields, modes):
    assert _parallel.active_modes(object()) == ["single"]  # without a parallel config
    pc = _pc(**fields)
    assert _parallel.active_modes(SimpleNamespace(parallel_config=pc)) == modes  # pipeline / transformer attribute
    assert _parallel.active_modes(SimpleNamespace(transformer=SimpleNamespace(parallel_config=pc))) == modes
    assert _parallel.active_modes(SimpleNamespace(od_config=SimpleNamespace(parallel_config=pc))) == modes


class _Opt:
    parallel_support = {  # noqa: RUF012
        "single": "supported",
        "ulysses": "supported",
        "ring": "off: the ring kernel ignores the mask",
        "cfg_parallel": "supported",
    }


@pytest.mark.parametrize(
    ("fields", "want"),
    [
        ({"ring_degree": 2}, ["off under vLLM-Omni ring parallelism: the ring kernel ignores the mask"]),
        ({"ulysses_degree": 2}, []),
        ({"tensor_parallel_size": 2}, ["off under vLLM-Omni tensor_parallel parallelism: not declared for this mode"]),
    ],
    ids=["declared_off", "supported", "undeclared"],
)
def test_reasons_name_the_mode_and_the_declared_reason(fields, want):
    model = SimpleNamespace(parallel_config=_pc(**fields))
    assert _parallel.parallel_reasons_inactive(_Opt(), model) == want


def test_every_registered_optimization_declares_every_parallel_mode():
    """``list`` prints these; a mode left out would silently read as "off"."""
    for opt in registry.all_optimizations():
        assert set(optimization.PARALLEL_MODES) <= set(opt.parallel_support), opt.name
        for mode, state in opt.parallel_support.items():
            assert state == "supported" or (state.startswith("off:") and state[4:].strip()), (opt.name, mode, state)
