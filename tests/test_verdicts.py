"""``blocks.verdicts.VerdictCache``: the one cache for kernel verdicts and its one invalidation rule.

The rule: a verdict belongs to the backend probe it was made under (``_backend.probe_id``); a new probe (another
``torch_npu`` module, a re-probe after ``_backend.reset_cache``) drops every entry before the next read or write, and
``clear()`` (an optimization's uninstall) drops them too. Nothing else removes a verdict.
"""

from __future__ import annotations

import pytest

from vllm_omni_ascend_opt import _backend
from vllm_omni_ascend_opt.blocks.kernels.verdicts import VerdictCache


def test_get_put_and_get_or_make():
    cache: VerdictCache[str] = VerdictCache()
    assert cache.get("a") is None and len(cache) == 0 and cache.values() == []
    assert cache.put("a", "ok") == "ok" and cache.get("a") == "ok"
    made = []
    assert cache.get_or_make("b", lambda: made.append(1) or "fresh") == ("fresh", True)
    assert cache.get_or_make("b", lambda: made.append(1) or "other") == ("fresh", False)  # made once
    assert made == [1]
    assert cache.get_or_make("a", lambda: pytest.fail("a put verdict is made again")) == ("ok", False)
    assert cache.put("a", "refused") == "refused" and cache.get("a") == "refused"  # put replaces
    assert sorted(cache.values()) == ["fresh", "refused"] and len(cache) == 2


def test_verdicts_live_as_long_as_the_probe():
    """Nothing but a new probe (or clear) removes a verdict: many reads under one probe keep every entry."""
    cache: VerdictCache[int] = VerdictCache()
    for i in range(5):
        cache.put(("shape", i), i)
    probe = _backend.probe_id()
    for _ in range(3):
        assert [cache.get(("shape", i)) for i in range(5)] == list(range(5))
    assert _backend.probe_id() == probe and len(cache) == 5


def test_a_new_probe_drops_every_verdict_on_every_path():
    cache: VerdictCache[str] = VerdictCache()
    cache.put("a", "ok")
    cache.put("b", "refused")
    probe = _backend.probe_id()
    _backend.reset_cache()  # the backend is probed afresh
    assert _backend.probe_id() != probe
    assert cache.get("a") is None and cache.get("b") is None and len(cache) == 0  # get
    cache.put("a", "old")
    _backend.reset_cache()
    assert cache.get_or_make("a", lambda: "new") == ("new", True)  # get_or_make
    _backend.reset_cache()
    cache.put("b", "fresh")  # put
    assert cache.values() == ["fresh"]  # values
    _backend.reset_cache()
    assert len(cache) == 0  # len


def test_another_torch_npu_module_drops_every_verdict(fake_npu):
    """What the tests do all the time (and a process that re-imports torch_npu): a verdict made with one module is
    never read under another."""
    fake_npu()
    cache: VerdictCache[str] = VerdictCache()
    cache.put(("cpu", "bfloat16"), "verified with the first fake")
    fake_npu(fusion_attention="wrong_polarity")
    assert cache.get(("cpu", "bfloat16")) is None and cache.values() == []


def test_clear_drops_everything_under_the_same_probe():
    cache: VerdictCache[str] = VerdictCache()
    cache.put("a", "ok")
    probe = _backend.probe_id()
    cache.clear()
    assert _backend.probe_id() == probe and cache.get("a") is None and len(cache) == 0
    assert cache.get_or_make("a", lambda: "again") == ("again", True)


def test_guard_backoff_schedule(monkeypatch):
    """Errors are retried after 1, 2, 4, 8, 16 forwards (capped at 32) and demoted after the 6th in a row; a
    TypeError is a verdict for the caller (not retried); a success after a fault clears it."""
    from collections import Counter

    from vllm_omni_ascend_opt.blocks.kernels import guard
    from vllm_omni_ascend_opt.blocks.upstream import forward_scope

    g, clock = guard.Guard("test", Counter()), [100]
    monkeypatch.setattr(forward_scope, "forwards", lambda: clock[0])

    def oom():
        raise RuntimeError("NPU out of memory. Tried to allocate 1 GiB")

    waits = []
    for _ in range(guard.MAX_ERRORS):
        assert g.run("k", oom) == (False, None, "") and g.waits("k")
        (f,) = g.faults()
        waits.append(f.retry_at - clock[0])
        clock[0] = f.retry_at
    assert waits == [1, 2, 4, 8, 16, 32] and f.demoted and f.kind == "out of memory"
    assert g.waits("k") and "demoted to stock after 6 errors" in f.describe()
    ok, _, refusal = g.run("t", lambda: int("x"))
    assert not ok and "ValueError" in refusal and g.stats["faults"] == 6  # a verdict, not a fault
    g.run("r", oom)
    clock[0] += 1
    assert not g.waits("r") and g.run("r", lambda: 7) == (True, 7, "") and [f.key for f in g.faults()] == ["k"]
