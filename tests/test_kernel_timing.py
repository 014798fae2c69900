"""Verified faster (``blocks/kernels/timing.py``): each kernel is timed against stock per shape class on the fake's
device clock and kept only where it wins by the margin; timings are saved, agreed across ranks and shown in status."""

from __future__ import annotations

import json
import multiprocessing
import os
import sys
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from tests.fake_torch_npu import build
from tests.harness.forward import tiny_forward
from vllm_omni_ascend_opt import _backend, _report, api, cli
from vllm_omni_ascend_opt.blocks.kernels import agree, saved, timing
from vllm_omni_ascend_opt.blocks.upstream import forward_scope
from vllm_omni_ascend_opt.opts import fused_attention, qk_norm
from vllm_omni_ascend_opt.opts import nz_weights as nz
from vllm_omni_ascend_opt.testbed import blockops
from vllm_omni_ascend_opt.testbed.pipeline import load_pipeline
from vllm_omni_ascend_opt.testbed.runtime import free_port

BF16 = torch.bfloat16


@pytest.fixture(autouse=True)
def _no_grad():
    with torch.no_grad():
        yield


def _norm(opt) -> nn.RMSNorm:
    norm = nn.RMSNorm(16, eps=1e-6).to(BF16)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    opt._swapped[norm] = nn.RMSNorm  # what attach does to a model's QK norms
    return norm


def _x(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(1, rows, 2, 16, generator=torch.Generator().manual_seed(seed)).to(BF16)


@pytest.mark.parametrize(
    ("kernel_ms", "gain_pct", "kept"), [(1.5, None, False), (0.5, None, True), (0.99, None, False), (0.99, "0.5", True)]
)
def test_a_kernel_is_kept_by_the_margin_a_slower_one_refused_saved_and_reported_with_both_figures(
    fake_npu, monkeypatch, kernel_ms, gain_pct, kept
):
    if gain_pct is not None:
        monkeypatch.setenv(timing.ENV_MIN_GAIN, gain_pct)
    npu = fake_npu(timed=True)
    npu.timing.set("npu_rms_norm", kernel_ms)  # stock: 1.0 ms
    opt = qk_norm.OPT
    opt.stats.clear()
    out = opt.path.apply(_norm(opt), _x(8))
    (v,) = opt.path.classes.values()
    assert (out is not None) is kept and v.ok is kept
    assert v.timing["kernel_ms"] == kernel_ms and v.timing["stock_ms"] == 1.0 and v.timing["ratio"] == kernel_ms
    assert v.timing["repeats"] == timing.REPEATS and opt.stats["timings"] == 2
    ok, reason, t = saved.lookup(opt.path.kernel, v.key)
    assert ok is kept and reason == v.reason and t["kernel_ms"] == kernel_ms and t["stock_ms"] == 1.0
    tally, calls = opt.path.tally(), npu.calls["npu_rms_norm"]
    if kept:
        assert tally["in_use"] == {v.place: {"candidate": "npu_rms_norm", "ratio": kernel_ms}}
        assert f"npu_rms_norm {kernel_ms:g} ms vs stock 1 ms, {kernel_ms:g}x" in v.describe()
    else:  # the class runs stock and the kernel is not called again
        assert v.reason.startswith(f"slower: kernel {kernel_ms:g} ms, stock 1 ms")
        assert tally["kernel"] == 0 and list(tally["why"]) == ["refused: " + v.reason]
        assert opt.path.apply(_norm(opt), _x(8, 1)) is None and npu.calls["npu_rms_norm"] == calls


def _attention(seed: int = 0, s: int = 24) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(1, s, 2, 16, generator=g).to(BF16) for _ in range(3))


def test_the_fastest_correct_attention_candidate_wins_and_a_faster_wrong_one_is_refused(fake_npu, monkeypatch):
    import vllm_omni.diffusion.attention.backends.sdpa  # noqa: F401  (before the fake: accelerate probes torch_npu)

    npu = fake_npu(timed=True, fused_infer_attention_score="ignores_scale")
    npu.timing.set("npu_fusion_attention", lambda *a, input_layout="BSH", **k: 0.8 if input_layout == "BSND" else 0.6)
    npu.timing.set("npu_fused_infer_attention_score", 0.2)  # fastest, but wrong
    opt = fused_attention.OPT
    q, k, v = _attention()
    assert opt.warm(q, k, v, None) is True
    (verdict,) = opt.path.classes.values()
    t = verdict.timing
    assert t["candidate"] == "npu_fusion_attention/BNSD" and t["kernel_ms"] == 0.6 and t["stock_ms"] == 1.0
    assert t["candidates"] == {"npu_fusion_attention": 0.8, "npu_fusion_attention/BNSD": 0.6,
                               "npu_fused_infer_attention_score": None}  # fmt: skip
    assert "tol" in t["refused"]["npu_fused_infer_attention_score"]  # refused with its reason
    fia, fa = npu.calls["npu_fused_infer_attention_score"], npu.calls["npu_fusion_attention"]
    scale = q.shape[-1] ** -0.5
    out = opt._call(npu, verdict.key, q, k, v, None, scale)  # a warm call runs the chosen candidate
    assert npu.calls["npu_fusion_attention"] == fa + 1 and npu.calls["npu_fused_infer_attention_score"] == fia
    ref = torch.nn.functional.scaled_dot_product_attention(*(x.transpose(1, 2).float() for x in (q, k, v)))
    assert (out.float() - ref.transpose(1, 2)).abs().max() < 2e-2


def test_a_second_start_reads_the_saved_timings_and_times_nothing(fake_npu):
    npu = fake_npu(timed=True)
    opt = qk_norm.OPT
    assert opt.path.apply(_norm(opt), _x(8)) is not None and npu.timing.elapsed > 0
    saved.forget()
    npu = fake_npu(timed=True)  # the restart: a new probe, nothing in memory
    opt.stats.clear()
    assert opt.path.apply(_norm(opt), _x(8, 1)) is not None
    assert opt.stats["shape_checks"] == 0 and opt.stats["timings"] == 0 and npu.timing.elapsed == 0
    (v,) = opt.path.classes.values()
    assert v.timing["ratio"] == 0.5 and opt.path.classes.loaded == 1


def test_timing_off_behaves_as_today(fake_npu, tmp_path):
    npu = fake_npu()  # timed=False: VLLM_OMNI_ASCEND_OPT_TIMING=0
    npu.timing.set("npu_rms_norm", 5.0)
    opt = qk_norm.OPT
    opt.stats.clear()
    assert opt.path.apply(_norm(opt), _x(8)) is not None  # correct is enough
    (v,) = opt.path.classes.values()
    assert v.ok and v.timing is None and npu.timing.elapsed == 0 and "timings" not in opt.stats
    assert " ms" not in v.describe() and saved.lookup(opt.path.kernel, v.key)[2] is None


def test_a_format_1_file_still_reads(fake_npu):
    fake_npu()
    saved.save("npu_rms_norm", ("npu:0", BF16, 16, 16), True, "checked")
    p = saved.path()
    data = json.loads(p.read_text())
    data["format"], data["verdicts"]["npu_rms_norm"]["npu|bfloat16|16|16"] = 1, [True, "checked"]
    p.write_text(json.dumps(data))
    saved.forget()
    assert saved.lookup("npu_rms_norm", ("npu:0", BF16, 16, 16)) == (True, "checked", None)


def test_ranks_agree_on_the_candidate_by_one_rule():
    """Passed and faster than its own stock on every rank, least worst-case ms, ties by candidate order."""
    order = ["a", "b", "c"]
    r0 = {"candidates": {"a": 0.8, "b": 0.5, "c": 0.4}, "stock_ms": 1.0}
    r1 = {"candidates": {"a": 0.7, "b": 0.6, "c": None}, "stock_ms": 1.0}
    assert timing.agreed([r0], order) == "c" and timing.agreed([r1], order) == "b"
    assert timing.agreed([r0, r1], order) == timing.agreed([r1, r0], order) == "b"
    r2 = {"candidates": {"a": 0.9, "b": 1.2, "c": 0.3}, "stock_ms": 1.0}
    assert timing.agreed([r0, r1, r2], order) == "a"  # b is slower than stock on rank 2
    assert timing.agreed([r1, {"candidates": {"a": 0.6, "b": 0.6}, "stock_ms": 1.0}], order) == "b"  # worst case
    assert timing.agreed([{"candidates": {"a": 0.5, "b": 0.5}, "stock_ms": 1.0}], order) == "a"  # ties: order
    assert timing.agreed([r1, {"candidates": {"a": 1.0, "b": 1.0}, "stock_ms": 1.0}], order) is None


def _rank(rank: int, port: int, out: str) -> None:
    try:
        os.environ[saved.ENV_VERDICT_CACHE] = os.path.join(out, f"cache{rank}")
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
        npu = build()
        if rank == 1:
            npu.timing.set("npu_rms_norm", lambda x, *a, **k: 1.5 if x.shape[1] > 8 else 0.5)  # slower at rows<=64
        sys.modules["torch_npu"], torch.npu = npu, npu._torch_npu_namespace
        _backend.reset_cache()
        opt = qk_norm.OPT
        norm = _norm(opt)
        used = []
        with torch.no_grad():
            for rows in (8, 20):
                used.append(opt.path.apply(norm, _x(rows, rank)) is not None)
        end = nn.Identity()
        forward_scope.watch(end, "test")
        end(None)  # the ranks agree at the end of a forward
        with torch.no_grad():
            for rows in (8, 20):
                used.append(opt.path.apply(norm, _x(rows, rank)) is not None)
        after = {str(v.key[2]): [v.ok, v.reason] for v in opt.path.classes.values()}
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump({"after": after, "used": used, "timings": opt.stats["timings"]}, f)
        dist.destroy_process_group()
    except BaseException:
        with open(os.path.join(out, f"rank{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        raise
    # Skip the interpreter's teardown: gloo's threads can abort the process there after everything was written.
    os._exit(0)


def test_two_ranks_where_one_measures_the_kernel_slower_both_run_stock(tmp_path):
    port = free_port()
    ctx = multiprocessing.get_context("spawn")
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
    assert r0["timings"] == r1["timings"] == 4  # both timed both classes (kernel and stock each)
    assert r1["after"]["64"][0] is False and r1["after"]["64"][1].startswith("slower: kernel 1.5 ms")
    assert r0["after"]["64"][0] is False and "refused on rank 1: slower" in r0["after"]["64"][1]
    assert r0["after"]["16"][0] is r1["after"]["16"][0] is True
    assert r0["used"] == r1["used"] == [False, False, True, False]  # waiting, then the agreed choice on both


def test_warmup_prints_stock_each_candidate_and_the_choice(fake_npu, monkeypatch, capsys):
    import vllm_omni.diffusion.attention.backends.sdpa  # noqa: F401  (before the fake: accelerate probes torch_npu)

    npu = fake_npu(timed=True)
    monkeypatch.setattr(torch, "npu", torch.npu, raising=False)
    monkeypatch.setattr("vllm_omni_ascend_opt._backend.npu_device", lambda: torch.device("cpu"))
    npu.timing.set("npu_rms_norm", lambda x, *a, **k: 1.2 if x.shape[1] > 8 else 0.7)  # slower on the image rows
    npu.timing.set("npu_fusion_attention", lambda *a, input_layout="BSH", **k: 0.9 if input_layout == "BSND" else 0.8)
    npu.timing.set("npu_fused_infer_attention_score", 0.6)
    args = ["warmup", "--sizes", "64x48", "--batch", "1", "--text", "8"]
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    fa = [ln for ln in lines if ln.startswith("npu_fusion_attention")]
    assert fa and all("stock 1 ms" in ln and "npu_fusion_attention 0.9 ms" in ln and "npu_fusion_attention/BNSD 0.8 ms"
                      in ln and ln.endswith("-> npu_fused_infer_attention_score") for ln in fa)  # fmt: skip
    norms = {ln.split()[1]: ln for ln in lines if ln.startswith("npu_rms_norm")}
    assert (
        norms["image"].endswith("-> stock") and " refused " in norms["image"] and "npu_rms_norm 1.2" in norms["image"]
    )
    assert norms["text"].endswith("-> npu_rms_norm") and "verified" in norms["text"]
    assert cli.main([*args, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert {r["timing"]["candidate"] for r in rows if r["kernel"] == "npu_fusion_attention"} == {
        "npu_fused_infer_attention_score"
    }
    assert all(r["timing"]["stock_ms"] == 1.0 for r in rows if r["outcome"] != "fault, deferred or no kernel")


def test_the_status_file_shows_the_candidate_in_use_and_its_ratio(fake_npu, runtime, bf16_transformer, tmp_path,
                                                                  monkeypatch):  # fmt: skip
    monkeypatch.setenv("VLLM_OMNI_ASCEND_OPT_STATUS_FILE", str(tmp_path / "status.json"))
    npu = fake_npu(timed=True)
    npu.timing.set("npu_rotary_mul", 2.0)  # rope: slower everywhere; qk_norm and attention: the default 0.5 ms
    api.select("default", model=bf16_transformer)
    tiny_forward(runtime, bf16_transformer)
    status = json.loads(_report.write_status_file(bf16_transformer).read_text())
    kernels = status["kernels"]
    assert kernels["rope"]["kernel"] == 0 and all(w.startswith("refused: slower: kernel 2 ms") for w in
                                                  kernels["rope"]["why"])  # fmt: skip
    for name, cand in (("qk_norm", "npu_rms_norm"), ("fused_attention", "npu_fusion_attention")):
        in_use = kernels[name]["in_use"]
        assert in_use and kernels[name]["kernel"] == len(in_use)
        assert all(u == {"candidate": cand, "ratio": 0.5} for u in in_use.values()), in_use


def test_launches_per_block_are_unchanged_where_every_kernel_wins(runtime, fake_npu):
    """NPU bf16 through the fake, warm, with timing on and every kernel faster: default 40, fast tier 28."""
    npu = fake_npu(timed=True)
    default = blockops.ops_per_block(runtime, "default")
    fast = blockops.ops_per_block(runtime, "default,+fast_modulate,+fast_residual")
    assert npu.timing.elapsed > 0  # the classes were timed (in the cold forward)
    assert (default.total, fast.total) == (40, 28), (default.counts, fast.counts)


@pytest.mark.parametrize("nz_ms", [0.8, 1.0])
def test_nz_weights_are_cast_only_where_the_nz_gemm_is_faster(fake_npu, runtime, nz_ms):
    """Per weight shape ND's GEMM vs NZ's (the fake prices plain GEMMs as ``stock``); not faster: SKIP_SLOWER, ND."""
    pipe = load_pipeline(runtime, dtype=BF16)
    npu = fake_npu(timed=True)
    region = iter(range(10**6))
    npu.timing.stock = lambda: 1.0 if (next(region) // timing.REPEATS) % 2 == 0 else nz_ms
    assert api.select("none,+nz_weights", model=pipe) == ["nz_weights"]
    report = nz.OPT.report(pipe)
    shapes = {k[2:4] for k in nz.OPT.path.timed}
    assert len(shapes) > 1 and nz.OPT.stats["timings"] == 2 * len(shapes)  # once per weight shape
    assert all(t["stock_ms"] == 1.0 and t["kernel_ms"] == nz_ms for t in nz.OPT.path.timed.values())
    if nz_ms < 1.0:
        assert report["cast"] and not report["skipped"]
    else:
        assert not report["cast"] and report["skipped"] == {nz.SKIP_SLOWER: 26}
    api.select("none", model=pipe)
    nz.OPT.stats.clear()
    assert api.select("none,+nz_weights", model=pipe) == ["nz_weights"]  # again: the saved timings, none measured
    assert nz.OPT.stats["timings"] == 0 and bool(nz.OPT.report(pipe)["cast"]) is (nz_ms < 1.0)
    api.select("none", model=pipe)


def test_ranks_agree_on_one_candidate_at_the_forward_end(fake_npu, monkeypatch):
    """Two ranks stubbed in-process: the peer found the fastest (infer) kernel slower; both run agreed's pick (BNSD)."""
    import vllm_omni.diffusion.attention.backends.sdpa  # noqa: F401  (before the fake: accelerate probes torch_npu)

    npu = fake_npu(timed=True)
    npu.timing.set("npu_fusion_attention", lambda *a, input_layout="BSH", **k: 0.8 if input_layout == "BSND" else 0.6)
    npu.timing.set("npu_fused_infer_attention_score", 0.4)
    monkeypatch.setattr(agree, "_group_size", lambda: 2)
    monkeypatch.setattr(agree, "_cpu_group", lambda: None)
    monkeypatch.setattr(dist, "get_world_size", lambda *a: 2)
    monkeypatch.setattr(dist, "get_rank", lambda *a: 0)
    peer = {
        "candidate": "npu_fusion_attention",
        "stock_ms": 1.0,
        "kernel_ms": 0.7,
        "candidates": {
            "npu_fusion_attention": 0.7,
            "npu_fusion_attention/BNSD": 0.7,
            "npu_fused_infer_attention_score": 1.1,
        },
    }

    def gather(everyone, mine, group=None):
        everyone[0] = mine
        everyone[1] = [(k, t, ok, r, peer) for k, t, ok, r, _ in mine]  # the peer met the same classes

    monkeypatch.setattr(dist, "all_gather_object", gather)
    opt = fused_attention.OPT
    q, k, v = _attention()
    assert opt.warm(q, k, v, None) is False  # the first-use check, held: waiting for the other rank
    agree.sync()
    assert opt.warm(q, k, v, None) is False  # the class, held
    (held,) = opt.path.classes.values()
    assert held.reason == agree.WAITING
    agree.sync()
    (verdict,) = opt.path.classes.values()
    assert verdict.ok and verdict.timing["candidate"] == "npu_fusion_attention/BNSD" and verdict.timing["agreed"]
    assert saved.lookup(opt.path.kernel, verdict.key)[2]["candidate"] == "npu_fusion_attention/BNSD"
    fa, fia = npu.calls["npu_fusion_attention"], npu.calls["npu_fused_infer_attention_score"]
    opt._call(npu, verdict.key, q, k, v, None, None)
    assert npu.calls["npu_fusion_attention"] == fa + 1 and npu.calls["npu_fused_infer_attention_score"] == fia
