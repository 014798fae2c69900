"""Every optimization under vLLM-Omni's own parallelism (TP, CFG-parallel, Ring and Ulysses SP; 2 gloo workers).

Each mode runs ``none``, ``default`` and ``all`` at shapes that catch caches keyed on too little (an odd token count
Ulysses pads, an even one of the same shard length, its transpose, other prompt lengths, the first again), in fp32
and in bf16 with the torch_npu double: ``default`` is bitwise ``none``, ranks agree, what can act is installed, what
``parallel_support`` declares off does not act, and ``none`` matches the single process.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.harness.parallel import (
    Job,
    ModeRun,
    ParallelRun,
    ParallelRunError,
    run_parallel,
    run_parallel_modes,
)
from vllm_omni_ascend_opt import registry

# one gloo spawn serves this module and test_devtime_model's collective counts: one xdist worker runs both
pytestmark = [pytest.mark.multiproc, pytest.mark.xdist_group("parallel_run")]

REPO = Path(__file__).resolve().parents[1]
TIMEOUT_S = 900.0  # a hang guard only

P1 = "a red cat"
P2 = "a small blue bird flying over the water at dawn"
# The tiny VAE downsamples 4x and the transformer packs 2x2 patches: an HxW image has (H/8)*(W/8) image tokens.
SHAPES = {
    "A": dict(height=24, width=24, prompt=P1),  # 9 tokens: Ulysses pads to 10, 5 per rank
    "B": dict(height=16, width=40, prompt=P2),  # 10 tokens: 5 per rank without padding (A's shard shape)
    "C": dict(height=40, width=16, prompt=P2),  # B transposed: identical shapes, different RoPE positions
    "D": dict(height=32, width=32, prompt=P1),  # 16 tokens (ring SP refuses odd counts: vLLM-Omni cannot mask there)
}
SINGLE_TOL = 1e-5  # max |none in the mode - single process| (images in [-1, 1]): reduction order only
UNMASKED_PADDING_TOL = 5e-3  # vLLM-Omni's default mask_sp_padding=False attends the zero padding token


#: The exact default optimizations (``default`` minus the close ones), for the torch_npu-double jobs.
EXACT_SPEC = "none," + ",".join(
    "+" + o.name for o in registry.all_optimizations() if o.default_enabled and o.equivalence == "exact"
)
BF16 = "bfloat16"  # the close NPU optimizations (fused attention, NZ weights) act on 16-bit models only
HOOKS = "tests.test_parallel:"


def _shape_keys(mode: str, npu: bool = False) -> list[str]:
    if npu:  # the NPU paths: padded + masked (mask polarity), padded, plain; stale caches are the fp32 runs' job
        return {"ulysses": ["A+mask", "A", "B"], "ring": ["B", "D"]}.get(mode, ["A", "B"])
    keys = ["B", "C", "D"] if mode == "ring" else ["A", "B", "C"]
    if mode == "ulysses":
        keys.append("A+mask")
    return keys


def _job(group: str, spec: str, key: str, again: bool = False, **kw) -> Job:
    base = SHAPES[key.split("+")[0]]
    mask = True if key.endswith("+mask") else None
    tag = f"{group}{'exact' if spec == EXACT_SPEC else spec}/{key}{'#again' if again else ''}"
    return Job(spec, mask_sp_padding=mask, tag=tag, **base, **kw)


def jobs_for(mode: str, specs: tuple[str, ...] = ("default",), group: str = "", npu: bool = False, **kw) -> list[Job]:
    """``none`` at every shape, then each spec at every shape back to back, then the first shape again."""
    keys = _shape_keys(mode, npu)
    jobs = [_job(group, "none", k, **kw) for k in keys]
    for spec in specs:
        jobs += [_job(group, spec, k, **kw) for k in keys]
        jobs.append(_job(group, spec, keys[0], again=True, **kw))
    return jobs


def npu_jobs(mode: str) -> list[Job]:
    """BF16: ``none``, then with the torch_npu double (its calls reported per job) every spec, the double removed."""
    plain = [_job("bf16:", "none", k) for k in _shape_keys(mode, npu=True)]
    npu = jobs_for(mode, ("default", EXACT_SPEC, "all"), group="npu:", npu=True, after=HOOKS + "fake_npu_calls")
    npu[0] = dataclasses.replace(npu[0], before=HOOKS + "install_fake_npu")
    npu[-1] = dataclasses.replace(npu[-1], after=HOOKS + "fake_npu_calls_and_remove")
    return plain + npu


def reference_tag(job: Job) -> str:
    """The ``none`` job of the same group and shape as ``job``."""
    group, rest = job.tag.rsplit(":", 1) if ":" in job.tag else ("", job.tag)
    return (group + ":" if group else "") + "none/" + rest.split("/", 1)[1].split("#")[0]


# one spawn runs every mode in turn (vLLM-Omni is imported once); its reports are shared by the tests below
SPAWN_ORDER = ("tensor_parallel", "cfg_parallel", "ring", "ulysses")
PLAN = [ModeRun(m, tuple(jobs_for(m, ("default", "all")))) for m in SPAWN_ORDER] + [
    ModeRun(m, tuple(npu_jobs(m)), dtype=BF16) for m in SPAWN_ORDER
]
_RUNS: dict[str, ParallelRun | BaseException] = {}


def _get_run(key: str, model_dir: Path) -> ParallelRun:
    if not _RUNS:
        try:
            runs = run_parallel_modes(PLAN, model_dir=model_dir, pythonpath=[str(REPO)], timeout_s=TIMEOUT_S)
            _RUNS.update(runs)
        except BaseException as exc:  # a failed spawn fails each test that needs it without running again
            _RUNS.update(dict.fromkeys((r.key for r in PLAN), exc))
    got = _RUNS[key]
    if isinstance(got, BaseException):
        raise got
    return got


@pytest.fixture(scope="module", params=[r.key for r in PLAN])
def run(request, tiny_model_dir) -> ParallelRun:
    """Every mode, in fp32 (CPU paths) and in bf16 with the torch_npu double (NPU paths)."""
    return _get_run(request.param, tiny_model_dir)


@pytest.fixture(scope="module")
def single(tiny_pipe, runtime):
    """``single(job)``: the single-process image for ``job``'s request (``none`` selected, 1 thread like a rank)."""
    from vllm_omni_ascend_opt import api

    cache: dict[tuple, torch.Tensor] = {}

    def ref(job: Job) -> torch.Tensor:
        key = (job.height, job.width, job.prompt, job.steps, job.seed, job.cfg_scale, job.negative_prompt)
        if key not in cache:
            threads = torch.get_num_threads()
            torch.set_num_threads(1)
            try:
                api.select("none", model=tiny_pipe)
                cache[key] = job.generate(tiny_pipe, runtime).images
            finally:
                torch.set_num_threads(threads)
        return cache[key]

    return ref


# hooks run inside the workers (imported there as tests.test_parallel)
def fail_on_rank1(rank: int) -> None:
    if rank == 1:
        raise RuntimeError("deliberate failure on rank 1")


def hang_on_rank1(rank: int) -> None:
    if rank == 1:
        time.sleep(3600)


_FAKE_NPU: list[pytest.MonkeyPatch] = []


def install_fake_npu(rank: int) -> None:
    """The torch_npu double, once the pipeline is built (vLLM-Omni keeps its CPU platform)."""
    from tests.fake_torch_npu import install

    mp = pytest.MonkeyPatch()
    install(mp)
    _FAKE_NPU.append(mp)


def fake_npu_calls(rank: int) -> dict[str, int]:
    """The double's kernel calls since the previous job."""
    log = sys.modules["torch_npu"].calls
    calls = dict(log)
    log.clear()
    return calls


def fake_npu_calls_and_remove(rank: int) -> dict[str, int]:
    """Last job of a mode: report, uninstall everything and take the double away for the next mode."""
    from vllm_omni_ascend_opt import _backend, api

    calls = fake_npu_calls(rank)
    api.select("none")
    _FAKE_NPU.pop().undo()
    _backend.reset_cache()
    return calls


@pytest.mark.parametrize(
    "mode, hook, timeout_s, message",
    [
        (
            "ulysses",
            "fail_on_rank1",
            900,
            r"rank\(s\) \[1\] failed \(exit codes \[None, 1\]\)[\s\S]*deliberate failure",
        ),
        ("tensor_parallel", "hang_on_rank1", 6, r"timed out \(exit codes \[None, None\]\)"),
    ],
    ids=["failing_rank", "hung_rank"],
)
def test_a_failing_or_hung_rank_stops_the_run_and_every_worker(tiny_model_dir, mode, hook, timeout_s, message):
    """A failing rank ends the run at once (rank 0, still waiting in the group, is killed, not waited for); a hung
    rank ends it at the deadline, never earlier; every worker is gone afterwards."""
    t = time.monotonic()
    with pytest.raises(ParallelRunError, match=message) as e:
        run_parallel(
            mode, [], model_dir=tiny_model_dir, setup=HOOKS + hook, pythonpath=[str(REPO)], timeout_s=timeout_s
        )
    assert time.monotonic() - t >= (timeout_s if hook == "hang_on_rank1" else 0)
    assert len(e.value.pids) == 2 and not any(Path(f"/proc/{p}").exists() for p in e.value.pids)


def test_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="valid: single, ulysses, ring, cfg_parallel, tensor_parallel"):
        run_parallel("pipeline", [])


def _psnr(a: torch.Tensor, b: torch.Tensor) -> float:
    mse = (a.double() - b.double()).pow(2).mean().item()
    return float("inf") if mse == 0 else 10 * torch.log10(torch.tensor(4.0 / mse)).item()  # range [-1, 1]


def test_parallel_state_and_each_job_alike_on_every_rank_matching_none_or_saying_why_not(run, single):
    """The groups exist as vLLM-Omni's worker makes them, and SP modes carry the transformer's ``_sp_plan`` hooks
    (vLLM-Omni only warns when applying them fails); Ulysses pads an odd token count (masked only with
    mask_sp_padding=True), 10 tokens need none. Per job, every rank returns the same image and acts alike;
    bitwise ``none`` of the same shape, also after other shapes ran in the same processes (a stale cache would show),
    or within PSNR 35 dB where close optimizations act (``all``, NPU paths). ``none`` with the torch_npu double is
    bitwise ``none`` without it and calls none of its kernels. Selected and able to act here => installed and
    attached; declared off in the mode => not acting; not acting => a reason; acting => counters show work. fp32
    ``none`` matches the single process."""
    size_key = {"ulysses": "ulysses", "ring": "ring", "cfg_parallel": "cfg", "tensor_parallel": "tp"}[run.mode]
    if run.dtype == "float32":
        assert not any(j.job.tag.startswith("npu:") for j in run.ranks[0].jobs)
    for r in run.ranks:
        assert r.active_modes == [run.mode]
        assert r.groups[f"{size_key}_size"] == 2 and r.groups[f"{size_key}_rank"] == r.rank
        if run.mode in ("ulysses", "ring"):
            assert r.groups["sp_size"] == 2
            assert {"sp_input---image_rope_prepare", "sp_output---proj_out"} <= set(r.sp_hooks)
            assert any("Applying sequence parallelism" in line for line in r.sp_log), r.sp_log
        else:
            assert r.groups["sp_size"] == 1 and r.sp_hooks == []
        if run.mode == "ulysses":  # 9 image tokens on 2 ranks: one padding token, in every transformer call (2 x 2)
            for j in r.jobs:
                want = (9, 1) if j.job.height == j.job.width == 24 else (None, 0)
                assert j.sp_padding == [want] * 4, (j.job.tag, j.sp_padding)
            if run.dtype == "float32":  # the padding token is attended unless masked (pins upstream's behaviour)
                assert not torch.equal(r.job("none/A").images, r.job("none/A+mask").images)
        for j, j0 in zip(r.jobs, run.ranks[0].jobs, strict=True):
            assert torch.equal(j.images, j0.images), f"{run.mode}@{run.dtype} {j.job.tag}: rank {r.rank} differs"
            assert (j.selected, j.installed, j.acting) == (j0.selected, j0.installed, j0.acting), j.job.tag
            assert j.extra == j0.extra, (j.job.tag, j.extra, j0.extra)  # the same torch_npu kernels on every rank
            if j.job.spec == "none":
                assert j.installed == [] and j.acting == [], f"{j.job.tag}: {j.installed}"
                if j.job.tag.startswith("npu:none/"):
                    plain = r.job("bf16:" + j.job.tag.removeprefix("npu:")).images
                    assert torch.equal(j.images, plain), j.job.tag
                    assert not j.extra, f"stock called torch_npu: {j.extra}"
                continue
            ref = r.job(reference_tag(j.job)).images
            assert j.images.shape == ref.shape
            where = f"{run.mode}@{run.dtype} rank {r.rank} {j.job.tag} (acting {j.acting})"
            close = [n for n in j.acting if registry.get(n).equivalence == "close"]
            if j.job.spec == "default" and ":" not in j.job.tag:
                assert not close, f"{where}: the default stack on CPU must be exact"
            if close:
                assert _psnr(j.images, ref) >= 35.0, where
            else:
                assert torch.equal(j.images, ref), f"{where} differs by {(j.images - ref).abs().max().item():.3e}"
            want = {"default": registry.default_names(), "all": registry.names()}.get(j.job.spec)
            if want is not None:
                assert j.selected == want, j.job.tag
            for name in j.selected:
                opt = registry.get(name)
                if not j.env_reasons[name]:
                    assert name in j.installed, f"{run.mode} {j.job.tag}: {name} can be active but is not installed"
                    assert "installed but not attached to this pipeline" not in j.reasons[name]
                if opt.parallel_support.get(run.mode, "") != "supported":
                    assert name not in j.acting, (
                        f"{name} declares {run.mode}: {opt.parallel_support.get(run.mode)!r} but acts in that mode"
                    )
                if name not in j.acting:
                    assert j.reasons[name], f"{name} does not act in {run.mode} and gives no reason"
                counters = j.stats.get(name)
                if name in j.acting and counters and "error" not in counters:
                    assert any(isinstance(v, (int, float)) and v for v in counters.values()), (
                        f"{name} acts in {run.mode} {j.job.tag} but its counters show no work: {counters}"
                    )
    if run.dtype == "float32":  # ``none`` against the single process (the ranks agree)
        diffs = {}
        for j in run.ranks[0].jobs:
            if j.job.spec == "none":
                d = diffs[j.job.tag] = (j.images - single(j.job)).abs().max().item()
                unmasked_pad = run.mode == "ulysses" and j.job.tag == "none/A"
                assert d <= (UNMASKED_PADDING_TOL if unmasked_pad else SINGLE_TOL), f"{run.mode} {j.job.tag}: {d:.3e}"
        if run.mode == "ulysses":  # masking the SP padding is never worse than attending it
            assert diffs["none/A+mask"] <= diffs["none/A"]
