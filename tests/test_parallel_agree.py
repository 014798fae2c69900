"""Ranks agree on every kernel verdict (``blocks/kernels/agree.py``): 2 gloo processes, rank 1 with a wrong
``npu_rms_norm``. At the forward's end rank 1's refusals replace rank 0's passes (a class only rank 1 met is refused on
rank 0 unchecked); until then rank 0's passes wait on the stock path, so the ranks never run different kernels.
"""

from __future__ import annotations

import json
import multiprocessing
import os

import torch
import torch.nn as nn


def _rank(rank: int, port: int, out: str) -> None:
    try:
        _run_rank(rank, port, out)
    except BaseException:
        import traceback

        with open(os.path.join(out, f"rank{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        raise
    os._exit(0)  # skip the interpreter's teardown, where gloo's threads can still abort the process


def _run_rank(rank: int, port: int, out: str) -> None:
    import sys

    import torch.distributed as dist

    from tests.fake_torch_npu import build
    from vllm_omni_ascend_opt import _backend
    from vllm_omni_ascend_opt.blocks.kernels import saved
    from vllm_omni_ascend_opt.blocks.upstream import forward_scope
    from vllm_omni_ascend_opt.opts import qk_norm

    os.environ[saved.ENV_VERDICT_CACHE] = os.path.join(out, f"cache{rank}")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    npu = build(**({"rms_norm": "no_gamma"} if rank == 1 else {}))
    sys.modules["torch_npu"], torch.npu = npu, npu._torch_npu_namespace
    _backend.reset_cache()
    opt = qk_norm.OPT
    norm = nn.RMSNorm(16, eps=1e-6)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    opt._swapped[norm] = nn.RMSNorm  # what attach does to a model's QK norms
    g = torch.Generator().manual_seed(rank)
    used = []  # per call: whether the kernel's output was used (None: the stock path)
    with torch.no_grad():
        used.append(opt.path.apply(norm, torch.randn(1, 8, 2, 16, generator=g)) is not None)  # rows<=16: both check it
        if rank == 1:
            opt.path.apply(norm, torch.randn(1, 20, 2, 16, generator=g))  # rows<=64: only rank 1 meets it
        else:
            used.append(opt.path.apply(norm, torch.randn(1, 100, 2, 16, generator=g)) is not None)  # rows<=256: rank 0
    before = {str(v.key[2]): [v.ok, v.reason] for v in opt.verdicts()}

    class _Forward(nn.Module):
        def forward(self) -> None:
            return None

    end = _Forward()
    forward_scope.watch(end, "test")
    end()  # the end of an outermost watched forward: the ranks agree there (agree.sync)
    with torch.no_grad():
        if rank == 0:
            opt.path.apply(norm, torch.randn(1, 20, 2, 16, generator=g))  # rank 0 meets rows<=64 now
            used.append(opt.path.apply(norm, torch.randn(1, 100, 2, 16, generator=g)) is not None)
    after = {str(v.key[2]): [v.ok, v.reason] for v in opt.verdicts()}
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"before": before, "after": after, "checks": opt.stats["shape_checks"], "used": used}, f)
    dist.destroy_process_group()


def test_two_ranks_agree_when_one_ranks_kernel_is_wrong(tmp_path):
    from vllm_omni_ascend_opt.testbed.runtime import free_port

    port = free_port()
    ctx = multiprocessing.get_context("spawn")  # fresh processes (pytest's may hold a process group of its own)
    procs = [ctx.Process(target=_rank, args=(r, port, str(tmp_path))) for r in (0, 1)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        if p.is_alive():
            p.kill()
    errors = [f.read_text() for f in sorted(tmp_path.glob("rank*.err"))]
    assert [p.exitcode for p in procs] == [0, 0], errors
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    # each on its own data; rank 0's passes wait for rank 1 (stock meanwhile): no rank used the kernel in forward 1
    assert {k: v[0] for k, v in r1["before"].items()} == {"16": False, "64": False}
    assert {k: v[0] for k, v in r0["before"].items()} == {"16": False, "256": False}
    assert all("waiting for the other ranks" in v[1] for v in r0["before"].values())
    assert r0["used"][:2] == [False, False] and r1["used"] == [False]
    assert {k: r0["after"][k][0] for k in r1["after"]} == {k: v[0] for k, v in r1["after"].items()}  # agreed
    assert r0["after"]["16"][0] is False and "refused on rank 1" in r0["after"]["16"][1]
    assert r0["after"]["64"][0] is False and "refused on rank 1" in r0["after"]["64"][1]
    assert r0["checks"] == 2  # rows<=64 was taken from rank 1's verdict, not checked again
    assert r0["after"]["256"][0] is True and r0["used"][2] is True  # a pass no rank refused takes effect after sync


def test_verdicts_are_exchanged_over_a_cpu_group_never_the_device_one(monkeypatch, tmp_path):
    """On a device backend (HCCL) ``all_gather_object`` moves the pickled verdicts through device memory and
    synchronizes the stream: the exchange runs over vLLM's world CPU group, or a gloo group made once."""
    import types

    import torch.distributed as dist
    from vllm.distributed import parallel_state

    from vllm_omni_ascend_opt.blocks.kernels import agree

    own = not dist.is_initialized()  # another test of this session may have left one
    if own:
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        made: list = []
        monkeypatch.setattr(agree, "_CPU_GROUPS", {})
        monkeypatch.setattr(dist, "get_backend", lambda *a: "hccl")
        monkeypatch.setattr(dist, "new_group", lambda **kw: made.append(kw) or "gloo-group")
        monkeypatch.setattr(parallel_state, "get_world_group", lambda: (_ for _ in ()).throw(AssertionError()))
        assert agree._cpu_group() == "gloo-group" and agree._cpu_group() == "gloo-group"
        assert made == [{"backend": "gloo"}]  # made once
        world = types.SimpleNamespace(world_size=dist.get_world_size(), cpu_group="vllm-cpu-group")
        monkeypatch.setattr(agree, "_CPU_GROUPS", {})
        monkeypatch.setattr(parallel_state, "get_world_group", lambda: world)
        gathered: list = []
        monkeypatch.setattr(agree, "_group_size", lambda: 2)
        monkeypatch.setattr(dist, "all_gather_object", lambda out, obj, group=None: gathered.append(group))
        agree.sync()
        assert gathered == ["vllm-cpu-group"] and len(made) == 1
    finally:
        if own:
            dist.destroy_process_group()
