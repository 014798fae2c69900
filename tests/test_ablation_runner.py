"""The runner with a protocol-speaking fake worker (tests/ablation_fake_worker.py): scheduling, crashes, timeouts,
interruption and resume, and the reports built from a run. No vLLM-Omni here: each fake process starts in ~0.2 s."""

from __future__ import annotations

import io
import itertools
import json
import os
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from PIL import Image

from vllm_omni_ascend_opt.ablation import engines, processes, report, stats, verdict, worker
from vllm_omni_ascend_opt.ablation import runner as runner_mod
from vllm_omni_ascend_opt.ablation.plan import OptInfo, build_plan
from vllm_omni_ascend_opt.ablation.runner import RunError, Runner
from vllm_omni_ascend_opt.ablation.schedule import williams_orders
from vllm_omni_ascend_opt.ablation.schema import validate
from vllm_omni_ascend_opt.ablation.workload import from_mapping

FAKE = [sys.executable, str(Path(__file__).with_name("ablation_fake_worker.py"))]
INFOS = [OptInfo("a", "exact"), OptInfo("b", "close"), OptInfo("off", "exact", reasons_inactive=("no NPU",))]


def make_plan(**kw):
    # timeouts are hang guards only (a fake worker answers in milliseconds; a busy machine must not fail a test)
    base = dict(
        seeds=[1, 2], repeats=2, warmup=1, height=16, width=16, start_jobs=3, timeout_s=300.0, start_timeout_s=600.0
    )
    return build_plan(from_mapping({**base, **kw}).validate(), INFOS)


def run(plan, out, monkeypatch, fake: dict, fresh=False):
    monkeypatch.setenv("ABLATION_FAKE", json.dumps(fake))
    data = Runner(plan, out, fresh=fresh, progress=False, worker_cmd=FAKE, log=lambda m: None).run()
    analysis = verdict.analyse(plan, data.records, data.out.root, interrupted=data.interrupted)
    results = report.build_results(data, analysis, command=["test"])
    report.write_all(results, out)
    return data, results


def starts(path: Path) -> list[str]:
    return [ln.split()[0] for ln in path.read_text().splitlines()] if path.exists() else []


GOOD = {"base_ms": 100.0, "saves_ms": {"a": 10.0, "b": 5.0}, "ctrl_offset_ms": 0.5, "perturb": {"b": 0.002}}


@pytest.mark.parametrize("schedule", ["resident", "per-round"])
def test_a_clean_run_passes_and_writes_valid_reports(tmp_path, monkeypatch, schedule):
    plan = make_plan(schedule=schedule)
    log = tmp_path / "starts.log"
    _, res = run(plan, tmp_path / "out", monkeypatch, {**GOOD, "starts_log": str(log)})
    out = tmp_path / "out"
    # one fresh process per configuration (resident) or per configuration and round (per-round)
    assert sorted(starts(log)) == sorted([c.id for c in plan.configs] * (1 if schedule == "resident" else 2))
    assert validate(json.loads((out / "results.json").read_text())) == []
    assert res["verdict"]["result"] == "PASS", res["verdict"]
    for c in plan.configs:  # isolation: every worker process got exactly its own configuration's flag
        assert f" flag {c.spec}\n" in (out / "configs" / c.id / "worker.log").read_text(), c.id
        job = json.loads((out / "configs" / c.id / "job.json").read_text())  # the engine's own waits follow the plan
        assert (job["timeout_s"], job["start_timeout_s"]) == (plan.workload.timeout_s, plan.workload.start_timeout_s)
    opts = {o["name"]: o for o in res["optimizations"]}
    assert opts["a"]["saved_ms"]["mean"] == pytest.approx(10.0) and opts["a"]["label"] == "gain"
    assert opts["b"]["saved_ms"]["per_round"] == pytest.approx([5.0, 5.0]) and opts["b"]["label"] == "gain"
    assert opts["a"]["equivalence_check"]["gate"]["passed"] is True
    assert opts["b"]["equivalence_check"]["worst"]["pixel_identical"] is False  # close, within the gates
    assert res["noise_floor"]["ms"] == pytest.approx(0.5)
    assert res["full_vs_stock"]["saved_ms"]["mean"] == pytest.approx(15.0)
    assert res["plan"]["skipped"] == {"off": ["no NPU"]}
    # every raw timing is there: configurations x rounds x samples, plus one warm-up per process
    measured = [s for s in res["samples"] if not s["warmup"]]
    assert len(measured) == len(plan.configs) * 2 * 2
    assert (out / "images" / "loo_a" / "p0_s1.png").is_file() and (out / "images" / "full" / "p0_s2.npy").is_file()
    # reports a person reads
    with Image.open(out / "ablation.png") as im:
        im.verify()
        assert im.format == "PNG" and im.size[0] > 300
    md = (out / "report.md").read_text()
    assert "**Verdict: PASS**" in md and "| `a` | exact | total | +10.00 ± 0.00 |" in md and "no NPU" in md
    assert res["information"] is None and "## Information" not in md  # only with vs_unquantized
    # interleaving: in every round each configuration ran once per sample, in rotated order
    order = [s["config"] for s in res["samples"] if not s["warmup"] and s["round"] == 0]
    if schedule == "resident":
        assert order[: len(plan.configs)] != order[len(plan.configs) :]


@pytest.mark.parametrize("perturb", [{"a": 0.2}, {"a": 0.002, "b": 0.002}], ids=["broken", "inside_the_close_gates"])
def test_exact_optimization_that_changes_the_image_fails_its_gate(tmp_path, monkeypatch, perturb):
    """Broken, or just beyond the exact boundary: the same small perturbation passes for the close optimization b."""
    _, res = run(make_plan(repeats=1), tmp_path / "out", monkeypatch, {**GOOD, "perturb": perturb})
    opts = {o["name"]: o for o in res["optimizations"]}
    a, b = opts["a"]["equivalence_check"], opts["b"]["equivalence_check"]
    if "b" in perturb:
        w = a["worst"]
        assert w["pixel_identical"] is False and w["ssim_min"] >= 0.99 and w["psnr_db_min"] >= 35
    assert a["gate"]["passed"] is False and b["gate"]["passed"] is True
    assert res["verdict"]["result"] == "FAIL"
    assert any(r.startswith("a (exact): gate failed") for r in res["verdict"]["reasons"])
    assert not any(r.startswith("b (close)") for r in res["verdict"]["reasons"])
    # strict JSON: the PSNR of identical images (the control against full) is the string "inf"
    text = (tmp_path / "out" / "results.json").read_text()
    assert "Infinity" not in text and "NaN" not in text
    full = next(c for c in json.loads(text)["configs"] if c["id"] == "full_ctrl")
    assert full["vs_full"]["worst"]["psnr_db_min"] == "inf" and full["vs_full"]["gate"]["passed"] is True


@pytest.mark.parametrize(
    "fault, expect",
    [
        ({"crash_start": ["loo_a"]}, "worker exited with code 3"),
        ({"die_run": {"loo_a": 2}}, "killed by SIGKILL (out of memory?)"),
        ({"error_run": {"loo_a": 3}}, "OutOfMemoryError: simulated"),
        ({"hang_run": {"loo_a": 2}}, "no answer within 6 s"),
    ],
)
def test_a_failing_configuration_is_recorded_and_the_run_goes_on(tmp_path, monkeypatch, fault, expect):
    # the hang case needs a per-run timeout that fires: 6 s, ~400x what a healthy fake worker's run takes
    plan = make_plan(timeout_s=6.0 if "hang_run" in fault else 300.0)
    _, res = run(plan, tmp_path / "out", monkeypatch, {**GOOD, **fault})
    bad = next(c for c in res["configs"] if c["id"] == "loo_a")
    assert bad["status"] == "failed" and expect in bad["error"]
    assert [f["config"] for f in res["failures"]] == ["loo_a"]
    if "crash_start" in fault:
        assert "simulated import crash" in res["failures"][0]["log_tail"]
    others = [c for c in res["configs"] if c["id"] != "loo_a"]
    assert all(c["status"] == "ok" for c in others)
    assert res["verdict"]["result"] == "FAIL" and res["verdict"]["exit_code"] == 1
    assert next(o for o in res["optimizations"] if o["name"] == "a")["label"] == "not measured"
    assert next(o for o in res["optimizations"] if o["name"] == "b")["label"] == "gain"
    assert validate(json.loads((tmp_path / "out" / "results.json").read_text())) == []


@pytest.fixture
def interruptible():
    """SIGINT raises KeyboardInterrupt in this process, as in a terminal, also when pytest was started in the
    background of a non-interactive shell (which starts it with SIGINT ignored, and Python then keeps it so)."""
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, old)


@pytest.mark.parametrize("schedule", ["resident", "per-round"])
def test_interrupted_run_resumes_where_it_stopped(tmp_path, monkeypatch, schedule, interruptible):
    plan = make_plan(schedule=schedule, repeats=3)
    out, log = tmp_path / "out", tmp_path / "starts.log"
    # the runner gets SIGINT: resident, in round 2 (loo_b's 5th request, warm-up included); per-round, while
    # loo_b's first process measures its first sample
    at = 5 if schedule == "resident" else 2
    data, res = run(plan, out, monkeypatch, {**GOOD, "starts_log": str(log), "sigint_parent": {"loo_b": at}})
    assert data.interrupted and res["verdict"]["result"] == "INCONCLUSIVE"
    first = starts(log)
    n_first = len([s for s in res["samples"] if not s["warmup"]])
    assert 0 < n_first < len(plan.configs) * 3 * 2
    log.unlink()
    data2, res2 = run(plan, out, monkeypatch, {**GOOD, "starts_log": str(log)})
    assert data2.resumed and not data2.interrupted
    measured = [s for s in res2["samples"] if not s["warmup"]]
    assert len(measured) == len(plan.configs) * 3 * 2
    keys = {(s["config"], s["round"], s["seed"]) for s in measured}
    assert len(keys) == len(measured)  # nothing measured twice
    assert res2["verdict"]["result"] == "PASS" and res2["run"]["resumed"]
    if schedule == "per-round":
        # finished (configuration, round) processes were kept: only the rest started again
        assert len(starts(log)) == len(plan.configs) * 3 - len(first) + 1
    else:
        assert sorted(starts(log)) == sorted(c.id for c in plan.configs)
    # a third run of the same plan has nothing left to do
    log.unlink()
    _, res3 = run(plan, out, monkeypatch, {**GOOD, "starts_log": str(log)})
    assert starts(log) == [] and res3["verdict"]["result"] == "PASS"


def test_resume_keeps_failures_fresh_starts_over_and_another_or_a_live_run_is_refused(tmp_path, monkeypatch):
    plan, out = make_plan(repeats=1), tmp_path / "out"
    run(plan, out, monkeypatch, {**GOOD, "crash_start": ["loo_b"]})
    _, res = run(plan, out, monkeypatch, GOOD)
    assert next(c for c in res["configs"] if c["id"] == "loo_b")["status"] == "failed"  # kept as failed on resume
    _, res = run(plan, out, monkeypatch, GOOD, fresh=True)
    assert res["verdict"]["result"] == "PASS" and not res["run"]["resumed"]
    with pytest.raises(RunError, match="different run"):
        run(make_plan(repeats=1, steps=3), out, monkeypatch, GOOD)
    (out / ".lock").write_text("1")  # pid 1 is alive
    with pytest.raises(RunError, match="in use"):
        run(plan, out, monkeypatch, GOOD)
    (out / ".lock").write_text("999999999")  # a dead run's lock is taken over
    run(plan, out, monkeypatch, GOOD)
    mine = {"plan.json", "measurements.jsonl", "results.json", "report.md", "ablation.png", "configs", "images"}
    assert {p.name for p in out.iterdir()} == mine  # nothing else, and no lock left behind
    assert not any(p for p in tmp_path.iterdir() if p.name != "out")


def test_without_a_control_there_is_no_noise_floor_and_reports_still_render(tmp_path, monkeypatch):
    plan = make_plan(repeats=1)
    _, res = run(plan, tmp_path / "out", monkeypatch, {**GOOD, "crash_start": ["full_ctrl"]})
    assert res["noise_floor"] is None
    assert {o["label"] for o in res["optimizations"]} == {"no noise floor"}
    assert "no noise floor (the control pair did not complete)" in res["verdict"]["reasons"]
    md = (tmp_path / "out" / "report.md").read_text()
    assert "Noise floor: **unknown**" in md and "## Failures" in md and "configs/full_ctrl/worker.log" in md
    with Image.open(tmp_path / "out" / "ablation.png") as im:
        im.verify()


def test_process_sets_restart_the_resident_workers_between_blocks_of_rounds(tmp_path, monkeypatch):
    """Each block of rounds gets fresh workers; every other block starts them in reverse order (a worker started
    early runs slower on some machines: each configuration gets an early and a late start)."""
    plan = make_plan(repeats=4, process_sets=2, seeds=[1])
    log = tmp_path / "starts.log"
    spawned: list[str] = []
    orig_spawn = runner_mod.Runner.spawn

    def spawn(self, c):
        spawned.append(c.id)
        return orig_spawn(self, c)

    monkeypatch.setattr(runner_mod.Runner, "spawn", spawn)
    _, res = run(plan, tmp_path / "out", monkeypatch, {**GOOD, "starts_log": str(log)})
    ids = [c.id for c in plan.configs]
    assert spawned == ids + ids[::-1]
    assert sorted(starts(log)) == sorted(ids * 2)
    pids = {s["round"]: s["pid"] for s in res["samples"] if not s["warmup"] and s["config"] == "full"}
    assert pids[0] == pids[1] != pids[2] == pids[3]
    assert res["verdict"]["result"] == "PASS"


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 6, 7, 8])
def test_williams_orders_balance_positions_and_predecessors(n):
    rows = williams_orders(n)
    assert len(rows) == (n if n % 2 == 0 or n == 1 else 2 * n)
    assert all(sorted(r) == list(range(n)) for r in rows)
    positions = Counter((pos, c) for r in rows for pos, c in enumerate(r))
    assert set(positions.values()) == {len(rows) // n}  # every configuration at every position equally often
    if n > 1:
        pairs = Counter((a, b) for r in rows for a, b in itertools.pairwise(r))
        assert len(pairs) == n * (n - 1) and len(set(pairs.values())) == 1  # every ordered neighbour pair alike


def test_resident_workers_warm_up_only_once_every_worker_is_ready_then_follow_the_williams_orders(
    tmp_path, monkeypatch
):
    """Warm-ups run in turn after the last worker reported ready (a worker warmed up while others still load, then
    left idle, measured slower); each measuring step then takes the next Williams order, so the predecessor of a
    configuration varies (with a rotation, 'full' would always run right after 'stock')."""
    plan = make_plan(repeats=3, seeds=[1, 2], warmup=2)
    data, res = run(plan, tmp_path / "out", monkeypatch, GOOD)
    kinds = [(r["type"], r.get("warmup"), r["config"]) for r in data.records if r.get("type") in ("ready", "sample")]
    last_ready = max(i for i, k in enumerate(kinds) if k[0] == "ready")
    warm = [i for i, k in enumerate(kinds) if k[0] == "sample" and k[1]]
    measured = [i for i, k in enumerate(kinds) if k[0] == "sample" and not k[1]]
    assert len(warm) == 2 * len(plan.configs) and last_ready < min(warm) and max(warm) < min(measured)
    # in turn: each configuration's warm-ups back to back
    assert [kinds[i][2] for i in warm] == [c.id for c in plan.configs for _ in range(2)]
    ids = [c.id for c in plan.configs]
    got = [s["config"] for s in res["samples"] if not s["warmup"]]
    rows = williams_orders(len(ids))
    assert got == [ids[i] for step in range(3 * 2) for i in rows[step % len(rows)]]
    before_full = {got[i - 1] for i in range(1, len(got)) if got[i] == "full" and i % len(ids)}
    assert len(before_full) >= 3


def _state(pid: int) -> str:
    """The process state letter from /proc (``T``: stopped)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat[stat.rfind(")") + 2]


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc")
@pytest.mark.parametrize("pause", [True, False])
def test_pause_idle_stops_every_other_worker_group_during_a_measurement(tmp_path, monkeypatch, pause):
    """With ``pause_idle`` each measured generation runs while every other resident worker and the engine process it
    started are stopped (SIGSTOP), the measured one is running; all exit cleanly (continued before "exit")."""
    plan = make_plan(repeats=2, seeds=[1], pause_idle=pause)
    log = tmp_path / "starts.log"
    live: list = []
    seen: list[tuple[str, list[str], list[str]]] = []
    exits: list[int | None] = []
    calls: dict[str, int] = {}
    orig_init, orig_run, orig_stop = processes.Worker.__init__, processes.Worker.run, processes.Worker.stop

    def groups() -> dict[str, list[int]]:
        return {ln.split()[0]: [int(x) for x in ln.split()[1:]] for ln in log.read_text().splitlines()}

    def init(self, *a, **k):
        orig_init(self, *a, **k)
        live.append(self)

    def run_(self, prompt, seed, save, timeout):
        calls[self.config.id] = calls.get(self.config.id, 0) + 1
        if calls[self.config.id] > plan.workload.warmup:  # a measured generation (every worker is up by then)
            g = groups()
            others = [p for w in live if w is not self and w.proc.poll() is None for p in g[w.config.id]]
            seen.append((self.config.id, [_state(p) for p in g[self.config.id]], [_state(p) for p in others]))
        return orig_run(self, prompt, seed, save, timeout)

    def stop(self, grace=30.0):
        orig_stop(self, min(grace, 10.0))  # a healthy fake worker exits at once; a stuck one is not waited for long
        exits.append(self.proc.returncode)

    monkeypatch.setattr(processes.Worker, "__init__", init)
    monkeypatch.setattr(processes.Worker, "run", run_)
    monkeypatch.setattr(processes.Worker, "stop", stop)
    _, res = run(plan, tmp_path / "out", monkeypatch, {**GOOD, "starts_log": str(log), "engine_child": True})
    assert res["verdict"]["result"] == "PASS"
    assert len(seen) == len(plan.configs) * 2 and all(len(g) == 2 for g in groups().values())
    assert all("T" not in mine for _, mine, _ in seen)
    if pause:
        assert all(others and set(others) == {"T"} for _, _, others in seen), [x for x in seen if set(x[2]) != {"T"}]
    else:
        assert all("T" not in others for _, _, others in seen), seen
    assert exits == [0] * len(plan.configs)  # each answered "exit" itself: none was left stopped and killed


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc")
def test_group_cpu_counts_every_process_of_the_group_and_nothing_else(tmp_path):
    """``others_cpu`` subtracts the CPU of the worker's whole process group: a child that burns CPU (as an engine
    process does) counts for its group, live or reaped, and not for another group."""
    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < {s}: pass\n"
    live = burn + "print('done', flush=True)\ntime.sleep(60)\n"
    script = tmp_path / "leader.py"
    script.write_text(
        "import subprocess, sys\n"
        f"subprocess.run([sys.executable, '-c', {burn.format(s=0.3)!r}])\n"  # a child of the group, reaped
        f"a = subprocess.Popen([sys.executable, '-c', {live.format(s=0.3)!r}], stdout=subprocess.PIPE, text=True)\n"
        # same session, another process group: not the worker's
        f"b = subprocess.Popen([sys.executable, '-c', {live.format(s=1.2)!r}], stdout=subprocess.PIPE, text=True,"
        " process_group=0)\n"
        "a.stdout.readline(); b.stdout.readline()\n"
        "print('burnt', b.pid, flush=True)\n"
        "import time; time.sleep(60)\n"
    )
    idle = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    leader = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, start_new_session=True)
    other = None
    try:
        word, other = leader.stdout.readline().split()
        assert word == "burnt"
        got = processes.group_cpu_s(leader.pid)
        assert 0.55 <= got < 1.2, got  # both 0.3 s children (the reaped one via cutime), not the other group's 1.2 s
        assert processes.group_cpu_s(int(other)) >= 1.2
        assert processes.group_cpu_s(idle.pid) < 0.3  # python start-up only
        assert processes.group_cpu_s(2**22 + 12345) == 0  # no such group: nothing
    finally:
        if other is not None:
            os.killpg(int(other), signal.SIGKILL)
        for proc in (leader, idle):
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_threads_reach_the_engine_processes_through_omp_num_threads(tmp_path, monkeypatch):
    """``threads`` sets the worker's torch threads and OMP_NUM_THREADS for the processes it starts (vLLM gives an engine
    worker one thread per core unless OMP_NUM_THREADS is set)."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    for threads, want in ((1, "1"), (0, None)):
        plan = make_plan(threads=threads)
        env = Runner(plan, tmp_path / f"o{threads}", progress=False, worker_cmd=FAKE, log=lambda m: None)._env(
            plan.config("full")
        )
        assert env.get("OMP_NUM_THREADS") == want


# ----------------------------------------------------------------------------------------------------------------
# the real worker's start-up check (the fake worker above echoes its configuration; this runs worker.serve itself)
# ----------------------------------------------------------------------------------------------------------------
class _StubEngine:
    """An engine whose active optimizations are given: what a worker whose plugin did not apply the flag sees."""

    device = "cpu"

    def __init__(self, job: dict, active: list[str]) -> None:
        self._active = active

    def load(self) -> None:
        pass

    close = load

    def active(self) -> list[str]:
        return list(self._active)

    def model_reasons(self, name: str) -> list[str]:
        return [f"{name}: not on this machine"]


def _serve(monkeypatch, active: list[str], wanted: list[str]) -> tuple[int, list[dict]]:
    monkeypatch.setattr(worker, "load_plugin_like_vllm_omni", lambda: None)
    monkeypatch.setitem(engines.ENGINES, "stub", lambda job: _StubEngine(job, active))
    job = {"protocol": worker.PROTOCOL_VERSION, "engine": "stub", "config": {"id": "c", "opts": wanted}}
    out = io.StringIO()
    rc = worker.serve({**job, "prompts": ["p"]}, out, iter(['{"cmd": "exit"}\n']))
    return rc, [json.loads(line) for line in out.getvalue().splitlines()]


@pytest.mark.parametrize(
    "active, why",
    [
        (["rope"], "shared_modulation is off (shared_modulation: not on this machine)"),
        (["rope", "shared_modulation", "vae_fast"], "vae_fast is active but was not requested"),
        ([], "rope is off"),
        (["shared_modulation", "rope"], None),  # exactly its configuration (in any order): ready
    ],
    ids=["missing", "extra", "none_active", "exact"],
)
def test_worker_refuses_when_active_optimizations_differ_from_the_configuration(monkeypatch, active, why):
    rc, events = _serve(monkeypatch, active, ["rope", "shared_modulation"])
    if why is None:
        assert rc == 0 and [e["event"] for e in events] == ["ready", "bye"]
        assert sorted(events[0]["active"]) == ["rope", "shared_modulation"]
        return
    assert rc == 3 and [e["event"] for e in events] == ["error"] and events[0]["phase"] == "start"
    assert "the worker's optimizations differ from the configuration" in events[0]["error"]
    assert why in events[0]["error"]


# ----------------------------------------------------------------------------------------------------------------
# stage-aware verdicts
# ----------------------------------------------------------------------------------------------------------------
STAGED_INFOS = [OptInfo("tr", "exact", stages=("denoise",)), OptInfo("vae", "exact", stages=("vae_decode",))]
STAGED = {"base_ms": 300.0, "saves_ms": {"tr": 10.0, "vae": 5.0}, "save_stage": {"tr": "denoise", "vae": "vae_decode"}}


def test_a_process_that_runs_one_stage_faster_is_process_bias_not_a_regression(tmp_path, monkeypatch):
    """The false FAIL of the plain tiny ablation: loo_vae's process runs denoise 20 ms faster (a stage vae does not
    change) and stock's process runs text encode 25 ms faster. On the total both read as regressions (a FAIL); on
    their own stages both save time, and the control stages name the bias: inconclusive, never FAIL or gain."""
    plan = build_plan(
        from_mapping(dict(seeds=[1, 2], repeats=2, warmup=0, height=16, width=16, timeout_s=300.0)).validate(),
        STAGED_INFOS,
    )
    fake = {
        **STAGED,
        "ctrl_offset_ms": 0.5,
        "stage_delay_ms": {"loo_vae": {"denoise": -20.0}, "stock": {"text_encode": -25.0}},
    }
    _, res = run(plan, tmp_path / "out", monkeypatch, fake)
    opts = {o["name"]: o for o in res["optimizations"]}
    vae, tr, fvs = opts["vae"], opts["tr"], res["full_vs_stock"]
    assert vae["total_saved_ms"]["mean"] == pytest.approx(-15.0)  # the total alone says: a regression
    assert vae["stages"] == ["vae_decode"] and vae["saved_ms"]["mean"] == pytest.approx(5.0)
    assert vae["control"]["stages"] == ["text_encode", "denoise"] and vae["control"]["bias"]
    assert vae["control"]["diff_ms"] == pytest.approx(-20.0)
    assert vae["label"] == stats.BIAS
    # tr saves 10 ms on denoise, but loo_vae's process ran denoise 20 ms faster than full's with nothing compared
    # there: the denoise floor spans that pair too, so tr's saving is within process noise (and no label)
    assert tr["label"] == stats.NOISE and tr["stages"] == ["denoise"] and not tr["control"]["bias"]
    assert tr["noise_floor_ms"] >= 20.0
    assert fvs["stages"] == ["denoise", "vae_decode"] and fvs["saved_ms"]["mean"] == pytest.approx(15.0)
    assert fvs["total_saved_ms"]["mean"] == pytest.approx(-10.0) and fvs["label"] == stats.BIAS
    v = res["verdict"]
    assert v["result"] == "INCONCLUSIVE", v
    text = " ".join(v["reasons"])
    assert "process bias in full stack vs stock" in text and "-25.00 ms" in text
    assert "process bias in vae's comparison" in text and "regression" not in text
    md = (tmp_path / "out" / "report.md").read_text()
    assert "process bias" in md and "vae_decode" in md
    # without the biased processes the same run passes, each line on its own stages
    _, res = run(plan, tmp_path / "clean", monkeypatch, {**STAGED, "ctrl_offset_ms": 0.5})
    assert res["verdict"]["result"] == "PASS" and "on denoise+vae_decode" in res["verdict"]["reasons"][0]


def test_repeated_vae_decodes_time_the_fastest_and_leave_the_extra_ones_out_of_the_total(monkeypatch):
    """``vae_decode_repeats``: the test-bed engine decodes the same latents again, times the stage as the fastest
    decode, returns the first decode's image and counts only one decode in the generation's total."""
    import torch

    assert "vae_decode_repeats" in runner_mod.JOB_FIELDS  # the workload's value reaches the worker
    clock = [0.0]
    monkeypatch.setattr(engines.time, "perf_counter", lambda: clock[0])
    took = iter([0.005, 0.002, 0.004, 0.003])  # s per decode: the second is the fastest
    calls = []

    def decode(latents):
        clock[0] += next(took)
        calls.append(latents)
        return torch.full((3, 2, 2), 0.5)

    eng = engines.TestbedEngine({"vae_decode_repeats": 4})
    eng.stages, eng.extra_ms = {}, 0.0
    first = eng._timed("vae_decode", decode)("z")
    assert calls == ["z"] * 4 and torch.equal(first, torch.full((3, 2, 2), 0.5))
    assert eng.stages["vae_decode"] == pytest.approx(2.0)
    assert eng.extra_ms == pytest.approx(14.0 - 2.0)  # what generate() takes off the measured total
    # other stages run once, and one repeat is the plain timer
    took = iter([0.007, 0.001])
    eng._timed("denoise", decode)("z")
    engines.TestbedEngine({"vae_decode_repeats": 1})._timed("vae_decode", decode)("z")
    assert len(calls) == 6 and eng.stages["denoise"] == pytest.approx(7.0)
    # a decode that does not repeat its image is an error, never a silently mixed measurement
    eng = engines.TestbedEngine({"vae_decode_repeats": 2})
    eng.stages, eng.extra_ms = {}, 0.0
    outs = iter([torch.zeros(3, 2, 2), torch.ones(3, 2, 2)])
    with pytest.raises(RuntimeError, match="another image"):
        eng._timed("vae_decode", lambda _: next(outs))("z")
