"""``_parallel``: which vLLM-Omni parallel modes a model runs in, and the reasons an optimization is off there."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from vllm_omni_ascend_opt import _parallel, optimization, registry


def _pc(**kw):
    base = dict(
        ulysses_degree=1,
        ring_degree=1,
        allgather_degree=1,
        cfg_parallel_size=1,
        tensor_parallel_size=1,
        vae_patch_parallel_size=1,
    )
    base.update(kw)
    return SimpleNamespace(**base)


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
    pc = _pc(**fields)
    assert _parallel.active_modes(SimpleNamespace(parallel_config=pc)) == modes  # pipeline / transformer attribute
    assert _parallel.active_modes(SimpleNamespace(transformer=SimpleNamespace(parallel_config=pc))) == modes
    assert _parallel.active_modes(SimpleNamespace(od_config=SimpleNamespace(parallel_config=pc))) == modes


def test_without_a_parallel_config_the_mode_is_single():
    assert _parallel.active_modes(object()) == ["single"]


class _Opt:
    parallel_support = {  # noqa: RUF012
        "single": "supported",
        "ulysses": "supported",
        "ring": "off: the ring kernel ignores the mask",
        "cfg_parallel": "supported",
    }


def test_reasons_name_the_mode_and_the_declared_reason():
    model = SimpleNamespace(parallel_config=_pc(ring_degree=2))
    assert _parallel.parallel_reasons_inactive(_Opt(), model) == [
        "off under vLLM-Omni ring parallelism: the ring kernel ignores the mask"
    ]
    assert _parallel.parallel_reasons_inactive(_Opt(), SimpleNamespace(parallel_config=_pc(ulysses_degree=2))) == []


def test_an_undeclared_mode_is_not_supported():
    model = SimpleNamespace(parallel_config=_pc(tensor_parallel_size=2))
    assert _parallel.parallel_reasons_inactive(_Opt(), model) == [
        "off under vLLM-Omni tensor_parallel parallelism: not declared for this mode"
    ]


def test_every_registered_optimization_declares_every_parallel_mode():
    """``list`` prints these; a mode left out would silently read as "off"."""
    for opt in registry.all_optimizations():
        assert set(optimization.PARALLEL_MODES) <= set(opt.parallel_support), opt.name
        for mode, state in opt.parallel_support.items():
            assert state == "supported" or (state.startswith("off:") and state[4:].strip()), (opt.name, mode, state)
