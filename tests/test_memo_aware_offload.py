"""memo_aware_offload under vLLM-Omni's layerwise offload: a warm forward leaves blocks 1..N-1's modulation weights
on the host, bitwise stock (TeaCache and MagCache too); a cold forward, a LoRA switch and a memo that loses an entry
copy what the blocks read; a storage-keyed memo would copy everything."""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass

import pytest
import torch

from tests.harness.runner import loaded
from vllm_omni_ascend_opt import _report, api, registry
from vllm_omni_ascend_opt.blocks.memo import keys as modulation_keys
from vllm_omni_ascend_opt.blocks.upstream.layerwise import block_hook, is_modulation
from vllm_omni_ascend_opt.opts import memo_aware_offload as mao
from vllm_omni_ascend_opt.testbed.offload import count_offload_copies

OPT, SM = mao.OPT, registry.get("shared_modulation")
REQUEST = {"height": 32, "width": 32, "steps": 2, "cfg_scale": 4.0}
FORWARDS = 2 * 2  # steps x CFG branches per request
TEA = {"cache_backend": "tea_cache", "cache_config": {"rel_l1_thresh": 0.6}}
MAG = {"cache_backend": "mag_cache", "cache_config": {"mag_ratios": [1.0] * 2, "mag_threshold": 0.5}}


@dataclass
class Offloaded:
    images: list[torch.Tensor]  # cold request, warm request
    bytes: list[int]  # host->device bytes per request
    stats: dict[str, int]  # memo_aware_offload, warm request
    memo: dict[str, int]  # shared_modulation, warm request
    fallbacks: dict[str, int]  # memo_aware_offload, warm request
    block_bytes: int  # one block's weights
    mod_bytes: int  # one block's img_mod / txt_mod weights


def _block_sizes(pipe) -> tuple[int, int]:
    hook = block_hook(pipe.transformer.transformer_blocks[1])._prev_hook  # the hook that prefetches block 1
    metas = [(m, t.element_size()) for d, t in hook.dtype_cpu_flattened_weights.items() for m in hook.dtype_metadata[d]]
    total = sum(m["numel"] * size for m, size in metas)
    return total, sum(m["numel"] * size for m, size in metas if is_modulation(m["name"]))


def offloaded(runtime, spec: str, **fields) -> Offloaded:
    with loaded(runtime, spec, enable_layerwise_offload=True, **fields) as h:
        images, moved = [], []
        for _ in range(2):
            for opt in registry.all_optimizations():
                opt.reset_stats()
            with count_offload_copies(h.pipeline) as copies:
                images.append(h.generate(**REQUEST))
            moved.append(copies.bytes)
        return Offloaded(
            images, moved, dict(OPT.stats), dict(SM.stats), OPT.fallback_reasons(), *_block_sizes(h.pipeline)
        )


@pytest.mark.parametrize("cache", [None, "tea_cache", "mag_cache"])
def test_warm_forwards_leave_the_modulation_weights_on_the_host(runtime, cache):
    fields = {None: {}, "tea_cache": TEA, "mag_cache": MAG}[cache]
    stock, ours = offloaded(runtime, "none", **fields), offloaded(runtime, "default", **fields)
    for a, b in zip(stock.images, ours.images, strict=True):
        assert torch.equal(a, b)
    assert torch.equal(ours.images[0], ours.images[1])
    assert ours.memo["hits"] > 0 and ours.memo.get("misses", 0) == 0, ours.memo  # warm: all from the memo
    assert ours.fallbacks == {} and ours.stats.get("late_copies", 0) == 0
    n = 2  # blocks of the tiny model
    forwards = ours.stats["forwards_skipping"]
    assert ours.stats.get("forwards_copying", 0) == 0
    # every forward that ran its blocks skipped the modulation weights of blocks 1..N-1, nothing else
    assert ours.stats["bytes_skipped"] == forwards * (n - 1) * ours.mod_bytes
    assert stock.bytes[1] - ours.bytes[1] == ours.stats["bytes_skipped"]
    if cache is None:
        assert forwards == FORWARDS and stock.bytes[1] == FORWARDS * n * ours.block_bytes
        assert ours.bytes[1] / stock.bytes[1] == pytest.approx(1 - (n - 1) / n * ours.mod_bytes / ours.block_bytes)
    else:
        assert 0 < forwards <= FORWARDS  # the cache backend skipped some forwards' blocks


def test_a_memo_that_loses_an_entry_or_is_storage_keyed_copies_bitwise(runtime, monkeypatch):
    """The memo cleared right after block 0's decision (warm request): block 1, whose modulation weights stayed on the
    host, misses and gets them copied before it runs: still bitwise, and the bytes add up."""
    ref = offloaded(runtime, "none")
    decide = OPT._before_block
    skips: list[int] = []
    cleared: list[bool] = []

    def decide_then_forget(module, args, kwargs):
        ring = decide(module, args, kwargs)
        if ring is not None and ring.skip and module is ring.transformer().transformer_blocks[0]:
            skips.append(1)
            if len(skips) == 3:  # the cold request's two CFG branches skipped; this is the warm request's first
                cleared.append(True)
                SM.memo.clear()
        return ring

    monkeypatch.setattr(OPT, "_before_block", decide_then_forget)
    got = offloaded(runtime, "default")
    assert cleared and all(torch.equal(a, b) for a, b in zip(ref.images, got.images, strict=True))
    assert got.stats["late_copies"] == 1
    assert any("left the memo" in why for why in got.fallbacks)
    # what was left on the host, minus what the late copy brought over
    assert ref.bytes[1] - got.bytes[1] == got.stats["bytes_skipped"] - got.mod_bytes
    # a memo keyed on device storage (emulated: a token that never repeats) finds no hit for the placeholders: every
    # forward copies every weight, and the output is stock's
    monkeypatch.setattr(OPT, "_before_block", decide)
    real = modulation_keys.tensor_state
    fresh = itertools.count()

    def storage_state(tensors, grad):
        return (*real(tensors, grad), next(fresh))

    monkeypatch.setattr(modulation_keys, "tensor_state", storage_state)  # every weight signature's per-call half
    ours = offloaded(runtime, "default")
    assert all(torch.equal(a, b) for a, b in zip(ref.images, ours.images, strict=True))
    assert ours.memo.get("misses", 0) > 0  # the storage key really missed under offload
    assert ours.stats.get("forwards_skipping", 0) == 0 and ours.stats["forwards_copying"] > 0
    assert ref.bytes[1] == ours.bytes[1]  # everything copied
    assert ours.stats.get("late_copies", 0) == 0


def test_lora_switch_under_offload_copies_the_new_weights(runtime, tmp_path):
    """A LoRA switch is a real weight change: the first forward after it misses and copies everything (the memo's
    signature sees the adapter), the CFG branch that follows skips again; bitwise stock throughout."""
    from tests.harness.lora import write_adapter

    def run(spec: str) -> tuple[list[torch.Tensor], list[dict[str, int]]]:
        with loaded(runtime, spec, enable_layerwise_offload=True) as h:
            lora = ("A", 1, str(write_adapter(tmp_path / spec, h.pipeline.transformer)), 1.0)
            h.enable_lora()
            images, stats = [], []
            for adapter in (None, None, lora, lora):
                OPT.reset_stats()
                images.append(h.generate(**REQUEST, lora=adapter))
                stats.append(dict(OPT.stats))
            return images, stats

    ref, _ = run("none")
    got, stats = run("default")
    assert all(torch.equal(a, b) for a, b in zip(ref, got, strict=True))
    assert not torch.equal(got[1], got[2])  # the adapter acts
    assert stats[1]["forwards_skipping"] == FORWARDS  # warm, no adapter
    assert stats[2]["forwards_copying"] == 2 and stats[2]["forwards_skipping"] == 2  # switched: each step's first
    assert stats[3]["forwards_skipping"] == FORWARDS  # warm with the adapter


def test_cold_forwards_probes_tracing_under_offload_and_upstream_change(runtime, monkeypatch):
    """A cold forward copies everything, with the reason. Upstream's materialization probe of a block is its first
    weight (img_mod.1.weight): a block whose modulation weights stay on the host must still read as materialized (or
    upstream copies it again), until uninstall. Under tracing the prefetch is stock's, nothing counted."""
    with loaded(runtime, "default") as h:
        (why,) = _report.explain(OPT, h.pipeline)
        assert "layerwise offload is not enabled" in why
        assert "memo_aware_offload" not in _report.acting(h.pipeline)
    with loaded(runtime, "default", enable_layerwise_offload=True) as h:
        assert "memo_aware_offload" in _report.acting(h.pipeline)
        blocks = h.pipeline.transformer.transformer_blocks
        hooks = [block_hook(b) for b in blocks]
        before = [hk._materialization_probe for hk in hooks]
        names = [{id(p): n for n, p in b.named_parameters()} for b in blocks]
        assert all(is_modulation(names[i][id(p)]) for i, p in enumerate(before))
        OPT.reset_stats()
        h.generate(**REQUEST)
        # each step's first forward meets a new temb and copies everything; its CFG branch (same temb) skips
        assert OPT.stats["forwards_copying"] == 2 and OPT.stats["forwards_skipping"] == 2
        assert OPT.fallback_reasons() == {mao.NOT_ALL_MEMOIZED: 2}
        assert _report.explain(OPT, h.pipeline) == []  # it acts on this model; the fallbacks say when it copies
        h.generate(**REQUEST)
        assert all(not is_modulation(names[i][id(hk._materialization_probe)]) for i, hk in enumerate(hooks))
        OPT.reset_stats()
        with monkeypatch.context() as m:
            m.setattr(torch.compiler, "is_compiling", lambda: True)
            with count_offload_copies(h.pipeline) as copies:
                hooks[0].pre_forward(blocks[0])  # stock: prefetch block 1 whole
        assert OPT.stats == {} and OPT.fallback_reasons() == {}
        assert copies.bytes == _block_sizes(h.pipeline)[0]
        api.select("none")  # uninstall: every probe is upstream's again
        assert [hk._materialization_probe for hk in hooks] == before
    api.select("default")  # an upstream change turns it off
    assert OPT.reasons_inactive() == []
    i = next(i for i, d in enumerate(mao.UPSTREAM) if d.qualname == "LayerwiseOffloadHook.prefetch_layer")
    unknown = dataclasses.replace(mao.UPSTREAM[i], known={"0" * 16: ("0.30.0",)})
    monkeypatch.setattr(OPT, "upstream", (*mao.UPSTREAM[:i], unknown, *mao.UPSTREAM[i + 1 :]))
    (why,) = OPT.reasons_inactive()
    assert "upstream LayerwiseOffloadHook.prefetch_layer differs" in why


def test_the_byte_counter_counts_only_copies_out_of_the_offloaders_host_weights(runtime):
    """testbed/offload.py: a copy from any other tensor (the model copies tensors too) is not host->device traffic of
    the offloader; a copy out of a block's host weights is, with its bytes."""
    from vllm_omni_ascend_opt.blocks.upstream.layerwise import host_weights

    with loaded(runtime, "none", enable_layerwise_offload=True) as h:
        host = host_weights(h.pipeline.transformer)[0]
        with count_offload_copies(h.pipeline) as copies:
            torch.empty(1000, dtype=host.dtype).copy_(torch.ones(1000, dtype=host.dtype))
            assert copies.bytes == 0 and copies.copies == 0
            torch.empty(10, dtype=host.dtype).copy_(host[:10])
        assert copies.bytes == 10 * host.element_size() and copies.copies == 1
