"""The ablation verdicts' false-alarm rate and power, by simulation on real noise.

tests/fixtures/ablation_null_rounds.json: every sample of a real ``tiny-cpu`` run whose configurations all run the
same code (tests/ablation_null_run.py). A simulated ``tiny-cpu`` run draws its rounds per process set without
replacement (the same rounds for every configuration), deals the recorded workers out to the roles at random and is
judged by :func:`verdict.timings` and :func:`verdict.decide`. A true effect of x% makes one leave-one-out's measured
stage x% longer (a gain) or shorter (a regression) in every sample.
"""

from __future__ import annotations

import json
import random
from functools import lru_cache
from pathlib import Path
from typing import Any

import pytest

from vllm_omni_ascend_opt.ablation import stats, verdict
from vllm_omni_ascend_opt.ablation.plan import OptInfo, Plan, build_plan
from vllm_omni_ascend_opt.ablation.schedule import process_sets
from vllm_omni_ascend_opt.ablation.workload import from_mapping, load_workload

FIXTURE = Path(__file__).parent / "fixtures" / "ablation_null_rounds.json"
RUNS = 1000
EFFECT = 0.10


@lru_cache(maxsize=1)
def recorded() -> tuple[dict[str, Any], Plan, stats.Means]:
    fx = json.loads(FIXTURE.read_text())
    infos = [OptInfo(n, "exact", stages=tuple(st)) for n, st in fx["stages"].items()]
    tiny = load_workload("tiny-cpu")
    wl = from_mapping(
        {
            "seeds": fx["workload"]["seeds"],
            "repeats": fx["workload"]["repeats"],
            "warmup": 0,
            "round_stat": tiny.round_stat,
        }
    )
    plan = build_plan(wl.validate(), infos)
    records = [{"type": "sample", "warmup": False, **s} for s in fx["samples"]]
    return fx, plan, stats.round_means(plan, records)


def simulated_plan() -> Plan:
    fx, rec_plan, _ = recorded()
    tiny = load_workload("tiny-cpu")
    wl = from_mapping({"seeds": fx["workload"]["seeds"], "repeats": tiny.repeats, "warmup": 0})
    return build_plan(wl.validate(), [rec_plan.opts[n] for n in rec_plan.stack])


def draw(rng: random.Random, plan: Plan, effect: tuple[str, float] | None = None) -> stats.Means:
    """One simulated run's round means (``effect``: (optimization, relative change of its leave-one-out's stage))."""
    fx, rec_plan, means = recorded()
    tiny = load_workload("tiny-cpu")
    rec_sets = process_sets(fx["workload"]["repeats"], fx["workload"]["process_sets"])
    want = [len(rs) for rs in process_sets(tiny.repeats, tiny.process_sets)]
    rounds = [r for rs, n in zip(rec_sets, want, strict=True) for r in rng.sample(rs, n)]
    workers = [c.id for c in rec_plan.configs]
    rng.shuffle(workers)
    out: stats.Means = {}
    for role, worker in zip([c.id for c in plan.configs], workers, strict=True):
        out[role] = {i: dict(means[worker][r]) for i, r in enumerate(rounds)}
    if effect:
        name, rel = effect
        comp = next(c for c in plan.comparisons if c.opt == name)
        for row in out[comp.without].values():
            for st in plan.stages_of({name}):
                delta = rel * row[st]
                row[st] += delta
                row["total"] += delta
    return out


def judge(plan: Plan, means: stats.Means) -> tuple[dict[str, Any], dict[str, Any]]:
    timed = verdict.timings(plan, means)
    for o in timed["optimizations"]:
        o["equivalence_check"] = None
    v = verdict.decide(plan, [], timed["optimizations"], timed["full_vs_stock"], timed["noise_floor"])
    return timed, v


def null_figures(runs: int = RUNS, seed: int = 0) -> dict[str, float]:
    plan, rng = simulated_plan(), random.Random(seed)
    fail = regression = gain = significant = 0
    for _ in range(runs):
        timed, v = judge(plan, draw(rng, plan))
        labels = [o["label"] for o in timed["optimizations"]] + [timed["full_vs_stock"]["label"]]
        fail += v["result"] == stats.FAIL
        regression += stats.REGRESSION in labels
        gain += stats.GAIN in labels
        significant += any(o["p_value"] <= stats.ALPHA for o in timed["optimizations"] if o["stages"] == ["denoise"])
    return {"fail": fail / runs, "regression": regression / runs, "gain": gain / runs, "fwer": significant / runs}


def power(rel: float, want: str, runs: int = RUNS, seed: int = 1) -> dict[str, float]:
    """Per optimization: the fraction of ``runs`` (dealt out in turn) in which its true effect got the label."""
    plan, rng = simulated_plan(), random.Random(seed)
    names = [c.opt for c in plan.comparisons]
    hits = dict.fromkeys(names, 0)
    for i in range(runs):
        name = names[i % len(names)]
        timed, _ = judge(plan, draw(rng, plan, (name, rel)))
        hits[name] += next(o for o in timed["optimizations"] if o["name"] == name)["label"] == want
    return {n: h * len(names) / runs for n, h in hits.items()}


def test_fixture_is_a_real_null_run_of_the_shipped_workload():
    fx, plan, means = recorded()
    tiny = load_workload("tiny-cpu")
    assert fx["workload"]["model"] == tiny.model and fx["workload"]["steps"] == tiny.steps
    assert fx["workload"]["process_sets"] == tiny.process_sets and fx["workload"]["threads"] == tiny.threads
    assert fx["workload"]["repeats"] > tiny.repeats  # rounds to draw from, without replacement
    assert fx["workload"]["vae_decode_repeats"] == tiny.vae_decode_repeats
    assert sorted(means) == sorted(c.id for c in plan.configs)
    assert all(len(rows) == fx["workload"]["repeats"] for rows in means.values())


def test_under_the_null_at_most_one_run_in_a_hundred_has_a_fail_or_a_regression():
    got = null_figures()
    print("null:", got)
    assert got["fail"] <= 0.01 and got["regression"] <= 0.01
    assert got["gain"] <= stats.ALPHA  # false gains (any optimization or the full stack) stay within the level
    # On denoise the corrected test alone holds the family-wise level (the noise floor only adds to it). On the
    # VAE decode, timed as the fastest of several decodes, two processes' steady offsets exceed the round-to-round
    # noise: the paired test finds them (they are real), and the floor over every null pair keeps them from a label.
    assert got["fwer"] <= stats.ALPHA + 0.02


#: The least power per measured stage: the issue's 90% on both (tiny-cpu times the VAE decode as the fastest of
#: several decodes, ``vae_decode_repeats``; with one decode its per-process offsets were the size of a 10% effect).
POWER = {"denoise": 0.90, "vae_decode": 0.90}


@pytest.mark.parametrize("rel, want", [(EFFECT, stats.GAIN), (-EFFECT, stats.REGRESSION)], ids=["gain", "regression"])
def test_a_true_ten_percent_effect_is_found_in_nine_runs_of_ten(rel, want):
    got = power(rel, want)
    print(f"power {want}: {got}")
    plan = simulated_plan()
    for name, share in got.items():
        assert share >= POWER[plan.stages_of({name})[0]], (name, share)


def test_holm_and_signed_rank_are_exact():
    # Holm: step-down, monotone, None left out of the family
    assert stats.holm([0.01, 0.04, None, 0.03]) == [0.03, 0.06, None, 0.06]
    # the exact null distribution: 8 rounds of one sign give 2/256, one small flip 4/256, ties mid-ranked
    assert stats.signed_rank_p([3.0] * 8) == 2 / 256
    assert stats.signed_rank_p([5.0] * 7 + [-1.0]) == 4 / 256
    assert stats.signed_rank_p([1.0, -1.0]) == 1.0 and stats.signed_rank_p([0.0, 0.0]) == 1.0
    assert stats.testable(8, 4) and not stats.testable(7, 4) and stats.testable(6, 1)
