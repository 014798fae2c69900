"""Kernel verdicts: ``ProbeDict`` (a verdict lives as long as its backend probe), ``VerdictStore`` (the disk asked
once per class and probe, a peer's refusal), the guard's backoff, saved verdicts and warm-up."""

from __future__ import annotations

import fcntl
import json
import logging
import multiprocessing
import os
import sys
import threading
from collections import Counter

import pytest
import torch

from tests.fake_torch_npu import build
from tests.harness.forward import tiny_forward
from vllm_omni_ascend_opt import _backend, _report, api, cli
from vllm_omni_ascend_opt.blocks.kernels import guard, npu_attention, rotary, saved
from vllm_omni_ascend_opt.blocks.kernels.verdicts import ProbeDict
from vllm_omni_ascend_opt.blocks.kernels.verified import KernelPath
from vllm_omni_ascend_opt.blocks.upstream import forward_scope
from vllm_omni_ascend_opt.opts import fused_attention, qk_norm, rope


class _Path(KernelPath):
    kernel = "k"


def test_get_put_values_clear_and_a_new_probe_drops_every_entry_and_says_so(fake_npu):
    """Only clear or a new probe (re-probe, another torch_npu) removes entries, on every access path; hook once each."""
    fake_npu()
    seen = []
    d: ProbeDict[str] = ProbeDict(lambda: seen.append(1))
    assert d.get("a") is None and len(d) == 0 and d.values() == [] and not d
    assert d.put("a", "ok") == "ok" and d.get("a") == "ok" and d
    assert d.put("a", "refused") == "refused" and d.get("a") == "refused"  # put replaces
    d.put("b", "fresh")
    assert sorted(d.values()) == ["fresh", "refused"] and len(d) == 2
    probe = _backend.probe_id()
    for _ in range(3):
        assert d.get("a") == "refused" and d.get("b") == "fresh"
    d.clear()
    assert _backend.probe_id() == probe and d.get("a") is None and len(d) == 0
    seen.clear()
    for access in (lambda: d.get("a"), lambda: d.values(), lambda: len(d), lambda: d.live()):
        d.put("a", "ok")
        _backend.reset_cache()  # the backend is probed afresh
        assert access() in (None, [], 0, {}) and len(d) == 0
    assert len(seen) == 4
    d.put(("cpu", "bfloat16"), "verified with the first fake")
    fake_npu(fusion_attention="wrong_polarity")
    assert d.get(("cpu", "bfloat16")) is None and d.values() == []


def test_a_class_is_asked_of_the_disk_once_per_probe(fake_npu, monkeypatch):
    """A class with no saved verdict (e.g. in fault backoff, looked up on every call) asks the disk once per probe."""
    fake_npu()
    asked: list = []
    lookup = saved.lookup
    monkeypatch.setattr(saved, "lookup", lambda kernel, key: asked.append(key) or lookup(kernel, key))
    store = _Path("test", Counter()).classes
    for _ in range(5):
        assert store.get(("npu:0", 1)) is None
    assert asked == [("npu:0", 1)]
    assert store.refuse_from_peer(saved.key_text(("npu:0", 1)), "refused on rank 1") is False  # not met here
    from vllm_omni_ascend_opt.blocks.kernels import agree

    agree._REMOTE.setdefault("k", {})[saved.key_text(("npu:0", 1))] = "refused on rank 1"  # as agree.sync stores it
    v = store.get(("npu:0", 1))
    assert (v.ok, v.reason) == (False, "refused on rank 1") and len(asked) == 1
    saved.save("k", ("npu:0", 2), True, "")
    v = store.get(("npu:0", 2))
    assert v.ok and v.reason == "saved verdict" and store.loaded == 1 and len(asked) == 2
    _backend.reset_cache()  # a new probe: asked again (the peer's refusal belonged to the old one)
    assert store.get(("npu:0", 1)) is None and len(asked) == 3


def test_guard_backoff_schedule(monkeypatch):
    """Retries after 1..16 forwards (cap 32), demoted after 6 errors; other errors are verdicts; a success clears."""
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


# ----- saved verdicts ---------------------------------------------------------------------------------------------
def test_a_second_start_with_saved_verdicts_runs_no_check(fake_npu, runtime, tiny_pipe):
    """Verdicts saved per device and software stack: a restart (a new probe, nothing loaded) takes them unchecked."""
    npu = fake_npu()
    tr = tiny_pipe.transformer
    api.select("none,+rope,+qk_norm", model=tr)
    first = tiny_forward(runtime, tr)
    checks = qk_norm.OPT.stats["shape_checks"], rope.OPT.stats["shape_checks"]
    assert all(checks) and saved.path().exists()
    assert _report.status_report()["saved_verdicts"] == {"path": str(saved.path()), "entries": saved.entries()}
    assert saved.entries() >= sum(checks)
    saved.forget()
    npu = fake_npu()  # the restart: a new probe, no verdict in memory
    qk_norm.OPT.stats.clear(), rope.OPT.stats.clear()
    second = tiny_forward(runtime, tr)
    assert torch.equal(first, second)
    assert qk_norm.OPT.stats["shape_checks"] == 0 and rope.OPT.stats["shape_checks"] == 0  # no check at all
    assert qk_norm.OPT.stats["kernel_calls"] == npu.calls["npu_rms_norm"] > 0
    assert npu.calls["npu_rotary_mul"] == rope.OPT.stats["kernel_calls"] > 0  # not even the toy check ran
    assert qk_norm.OPT.path.classes.loaded == len(qk_norm.OPT.verdicts()) > 0


@pytest.mark.parametrize(
    ("damage", "warning"),
    [
        (lambda p, d: p.write_text("{not json"), "not valid JSON"),
        (lambda p, d: p.write_text(json.dumps({**d, "format": 0})), "format 0 is not 2"),
        (lambda p, d: p.write_text(json.dumps({**d, "env": {**d["env"], "cann": "8.2.RC1"}})), "another device"),
    ],
)
def test_corrupt_older_or_foreign_files_are_ignored_with_one_warning(fake_npu, caplog, damage, warning):
    fake_npu()
    saved.save("npu_rms_norm", ("npu:3", torch.bfloat16, 64, 128), True, "")
    p = saved.path()
    data = json.loads(p.read_text())
    assert data["verdicts"] == {"npu_rms_norm": {"npu|bfloat16|64|128": [True, "", None]}}  # no device index
    assert set(data["env"]) == {"device", "soc", "cann", "torch_npu", "torch", "plugin"}
    assert data["env"]["device"] == "FakeAscend910B1" and data["env"]["cann"] == "8.3.RC1"
    damage(p, data)
    saved.forget()
    with caplog.at_level(logging.WARNING, logger="vllm_omni_ascend_opt"):
        assert saved.lookup("npu_rms_norm", ("npu:0", torch.bfloat16, 64, 128)) is None
        assert saved.lookup("npu_rms_norm", ("npu:0", torch.bfloat16, 64, 128)) is None
    assert caplog.text.count("ignoring the saved kernel verdicts") == 1 and warning in caplog.text
    saved.save("npu_rms_norm", ("npu:0", torch.float16, 64, 128), False, "differs")  # replaced by the next write
    saved.forget()
    assert saved.lookup("npu_rms_norm", ("npu:1", torch.float16, 64, 128)) == (False, "differs", None)


def test_the_env_var_moves_or_disables_the_cache(fake_npu, monkeypatch, tmp_path):
    fake_npu()
    monkeypatch.setenv(saved.ENV_VERDICT_CACHE, str(tmp_path / "here"))
    saved.save("k", ("npu:0", 1), True, "")
    assert saved.path().parent == tmp_path / "here" and saved.path().exists()
    for off in ("0", "off", "none"):
        monkeypatch.setenv(saved.ENV_VERDICT_CACHE, off)
        assert saved.directory() is None and saved.path() is None and saved.lookup("k", ("npu:0", 1)) is None
    monkeypatch.delenv(saved.ENV_VERDICT_CACHE)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert saved.directory() == tmp_path / "xdg" / "vllm-omni-ascend-opt" / "verdicts"


def _writer(args):
    path, who = args
    os.environ[saved.ENV_VERDICT_CACHE] = path
    sys.modules["torch_npu"] = build()
    torch.npu = sys.modules["torch_npu"]._torch_npu_namespace
    _backend.reset_cache()
    saved.forget()
    for i in range(40):
        saved.save("k", (who, i), True, "")
    return True


def test_concurrent_writers_never_leave_a_torn_file_a_save_waits_for_the_lock(tmp_path, fake_npu):
    """Two processes saving at once: both's entries, parseable; while another process holds the flock, no write."""
    with multiprocessing.get_context("fork").Pool(2) as pool:
        assert pool.map(_writer, [(str(tmp_path), "a"), (str(tmp_path), "b")]) == [True, True]
    (p,) = tmp_path.glob("verdicts-*.json")
    table = json.loads(p.read_text())["verdicts"]["k"]
    assert len(table) == 80 and not list(tmp_path.glob(".*.tmp"))
    fake_npu()
    p = saved.path()
    p.parent.mkdir(parents=True, exist_ok=True)
    with open(p.with_name(p.name + ".lock"), "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        t = threading.Thread(target=saved.save, args=("k", ("npu:0", 1), True, ""))
        t.start()
        t.join(0.5)
        assert t.is_alive() and not p.exists()
    t.join(60)
    saved.forget()
    assert not t.is_alive() and saved.lookup("k", ("npu:0", 1)) == (True, "", None)


def test_batch_times_heads_is_bucketed_like_the_sequence():
    """CFG's batch of 2 and a 2-way head split share a class with B=1 at all heads (24 -> 32), as the code says."""
    one, split = torch.empty(1, 100, 24, 128), torch.empty(2, 100, 12, 128)
    assert rotary.shape_class(one) == rotary.shape_class(split) and rotary.shape_class(one)[3] == 32
    assert rotary.shape_class(torch.empty(2, 100, 24, 128))[3] == 64
    assert npu_attention.shape_class(one, one, None) == npu_attention.shape_class(split, split, None)


def test_warmup_checks_the_classes_then_a_start_runs_none(fake_npu, monkeypatch, capsys):
    """``warmup`` checks each class once and saves the verdicts; a second start finds them all and checks nothing."""
    import vllm_omni.diffusion.attention.backends.sdpa  # noqa: F401  (before the fake: accelerate probes torch_npu)

    fake_npu()
    monkeypatch.setattr(torch, "npu", torch.npu, raising=False)
    monkeypatch.setattr("vllm_omni_ascend_opt._backend.npu_device", lambda: torch.device("cpu"))
    args = ["warmup", "--sizes", "64x48,32x32", "--batch", "1,2", "--sp", "2", "--text", "8"]
    assert cli.main(args) == 0
    lines = capsys.readouterr().out.splitlines()
    rows, last = [ln for ln in lines if ln.startswith("npu_")], lines[-1]
    assert rows and all(ln.split()[-3] == "verified" for ln in rows)
    assert "0 refused, 0 not decided" in last and str(saved.path()) in last
    checks = sum(o.stats["shape_checks"] for o in (rope.OPT, qk_norm.OPT, fused_attention.OPT))
    assert checks == len(rows) > 10
    saved.forget()
    fake_npu()  # the next start
    for o in (rope.OPT, qk_norm.OPT, fused_attention.OPT):
        o.stats.clear()
    assert cli.main(args) == 0
    assert sum(o.stats["shape_checks"] for o in (rope.OPT, qk_norm.OPT, fused_attention.OPT)) == 0
    assert cli.main(["warmup", "--sizes", "100x7"]) == 2 and "multiples of 16" in capsys.readouterr().err
