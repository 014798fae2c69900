"""From a workload, a mode and the registry to the configurations an ablation runs (docs/ablation.md, "Modes and
configurations"): ``stock``, ``full``, ``full_ctrl`` (the noise floor) and what the mode adds, same sets merged."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from dataclasses import dataclass, field
from typing import Any

from vllm_omni_ascend_opt.ablation.workload import Workload, WorkloadError
from vllm_omni_ascend_opt.optimization import STAGES


@dataclass(frozen=True)
class OptInfo:
    """What the planner needs of one ``Optimization`` (``equivalence``: its ``tier()``; ``stages``: changed ones)."""

    name: str
    equivalence: str
    default_enabled: bool = True
    reasons_inactive: tuple[str, ...] = ()
    summary: str = ""
    close_gates: tuple[float, float] | None = None  # (SSIM, PSNR dB); None: the workload's gates
    needs: tuple[str, ...] = ()
    needs_config: tuple[tuple[str, Any], ...] = ()
    stages: tuple[str, ...] = STAGES


def opt_infos_from_registry() -> list[OptInfo]:
    """One :class:`OptInfo` per registered optimization, in registry order, with its reasons to be off here."""
    from vllm_omni_ascend_opt import registry

    out = []
    for opt in registry.all_optimizations():
        try:
            reasons = tuple(opt.reasons_inactive())
        except Exception as exc:  # a broken probe is itself a reason
            reasons = (f"reasons_inactive() raised {exc!r}",)
        gates = tuple(opt.close_gates) if opt.close_gates is not None else None
        info = (opt.name, opt.tier(), opt.default_enabled, reasons, opt.summary, gates, tuple(opt.needs))
        out.append(OptInfo(*info, tuple(sorted(opt.needs_config.items())), opt.changed_stages()))
    return out


#: The role of a configuration measured for information only: no verdict, gate or exit code depends on it.
INFORMATION = "information"
#: The ``vs_unquantized`` information configuration: stock with the workload's od_config minus its quantization.
UNQUANTIZED = "stock_unquantized"
#: The od_config field that holds vLLM-Omni's quantization (``int8``); the only one the information run drops.
QUANTIZATION_KEY = "quantization_config"


@dataclass(frozen=True)
class Config:
    id: str  # file-system safe, unique
    label: str  # for people
    opts: tuple[str, ...]  # in registry order
    role: str  # stock | full | control | leave-one-out | cumulative | single | information
    #: od_config fields this configuration runs without (the workload's others stay): its worker's job drops them.
    od_drop: tuple[str, ...] = ()

    @property
    def spec(self) -> str:
        return ",".join(["none", *(f"+{n}" for n in self.opts)])

    def od_config(self, workload_od: dict[str, Any]) -> dict[str, Any]:
        """The vLLM-Omni modes this configuration's worker runs with: the workload's, less :attr:`od_drop`."""
        return {k: v for k, v in workload_od.items() if k not in self.od_drop}

    def as_dict(self) -> dict[str, Any]:
        """The fields that identify it (``od_drop`` only when set: plans without it keep their fingerprint)."""
        d = dataclasses.asdict(self)
        if not self.od_drop:
            del d["od_drop"]
        return d


#: Workload fields that do not change what a measurement means (presentation, gates and patience).
UNMEASURED = "name description start_jobs timeout_s start_timeout_s ssim_gate psnr_gate min_improvement_pct".split()


@dataclass(frozen=True)
class Comparison:
    """``opt``'s time saved = time(``without``) - time(``with_``); its equivalence is judged on these two images."""

    opt: str
    with_: str
    without: str


@dataclass
class Plan:
    workload: Workload
    configs: list[Config]
    comparisons: list[Comparison]
    stack: list[str]
    skipped: dict[str, list[str]]
    opts: dict[str, OptInfo]
    engine: str
    schedule: str
    model_path: str | None = None
    extra_imports: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def config(self, cid: str) -> Config:
        for c in self.configs:
            if c.id == cid:
                return c
        raise KeyError(cid)

    @property
    def samples(self) -> list[tuple[int, int]]:
        """(prompt index, seed) of every image of one repeat, in run order."""
        return [(p, s) for p in range(len(self.workload.prompts)) for s in self.workload.seeds]

    def diff(self, a: str, b: str) -> set[str]:
        """The optimizations configurations ``a`` and ``b`` differ by."""
        return set(self.config(a).opts) ^ set(self.config(b).opts)

    def close_gates(self, names: list[str] | tuple[str, ...] | set[str]) -> dict[str, float]:
        """The loosest own gates of the ``close`` optimizations in ``names`` (their errors add), else the workload's."""
        wl = self.workload
        own = [
            self.opts[n].close_gates or (wl.ssim_gate, wl.psnr_gate)
            for n in names
            if self.opts[n].equivalence == "close"
        ]
        if not own:
            return {"ssim": wl.ssim_gate, "psnr_db": wl.psnr_gate}
        return {"ssim": min(g[0] for g in own), "psnr_db": min(g[1] for g in own)}

    def stages_of(self, names: list[str] | tuple[str, ...] | set[str]) -> tuple[str, ...]:
        """The stages some of ``names`` can change, in request order: what a comparison of them is measured on."""
        own = {st for n in names for st in self.opts[n].stages}
        return tuple(st for st in STAGES if st in own)

    def fingerprint(self) -> str:
        """Hash of everything that makes stored measurements reusable (a resume must match it exactly)."""
        wl = self.workload
        # the tiny model's built directory is named by a hash of its spec and seed
        model = f"tiny:{wl.tiny_spec().key(0)}" if wl.is_tiny else self.model_path or wl.model
        blob = json.dumps(
            {
                "workload": {k: v for k, v in wl.to_dict().items() if k not in UNMEASURED},
                "configs": [c.as_dict() for c in self.configs],
                "engine": self.engine,
                "schedule": self.schedule,
                "model": model,
                "imports": self.extra_imports,
            },
            sort_keys=True,
        )
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    def to_dict(self) -> dict[str, Any]:
        return {
            "workload": self.workload.to_dict(),
            "engine": self.engine,
            "schedule": self.schedule,
            "model_path": self.model_path,
            "stack": list(self.stack),
            "skipped": {k: list(v) for k, v in self.skipped.items()},
            "optimizations": {
                n: {
                    "equivalence": o.equivalence,
                    "default": o.default_enabled,
                    "summary": o.summary,
                    "close_gates": self.close_gates([n]) if o.equivalence == "close" else None,
                    "stages": list(o.stages),
                }
                for n, o in self.opts.items()
            },
            "configs": [
                {**dataclasses.asdict(c), "opts": list(c.opts), "od_drop": list(c.od_drop), "spec": c.spec}
                for c in self.configs
            ],
            "comparisons": [{"opt": c.opt, "with": c.with_, "without": c.without} for c in self.comparisons],
            "imports": list(self.extra_imports),
            "notes": list(self.notes),
            "fingerprint": self.fingerprint(),
        }


def _names(csv: list[str] | None, valid: list[str], what: str) -> list[str]:
    names = [n.strip() for item in csv or [] for n in item.split(",") if n.strip()]
    for n in names:
        if n not in valid:
            raise WorkloadError(f"{what}: unknown optimization {n!r}; valid names: {', '.join(valid)}")
    return list(dict.fromkeys(names))


def build_plan(
    workload: Workload,
    infos: list[OptInfo],
    *,
    only: list[str] | None = None,
    skip: list[str] | None = None,
    order: list[str] | None = None,
    engine: str | None = None,
    extra_imports: list[str] | None = None,
) -> Plan:
    """The configurations and comparisons of one run. ``infos`` in registry order. Raises WorkloadError."""
    valid = [i.name for i in infos]
    by_name = {i.name: i for i in infos}
    only_l = _names(only, valid, "--only")
    skip_l = _names(skip, valid, "--skip")
    order_l = _names(order, valid, "--order")
    skipped: dict[str, list[str]] = {}
    stack: list[str] = []
    for info in infos:
        n = info.name
        if only_l and n not in only_l:
            skipped[n] = ["not named by --only"]
        elif n in skip_l:
            skipped[n] = ["excluded by --skip"]
        elif info.reasons_inactive:
            skipped[n] = list(info.reasons_inactive)
        elif unmet := [f"{k}={v!r}" for k, v in info.needs_config if workload.od_config.get(k) != v]:
            skipped[n] = [
                f"acts only with {', '.join(unmet)} (a vLLM-Omni mode this workload's od_config does not set)"
            ]
        elif not info.default_enabled and workload.stack != "all" and n not in only_l:
            skipped[n] = [f"off by default ({info.equivalence}); include it with --stack all or --only {n}"]
        else:
            stack.append(n)
    changed = True
    while changed:  # an optimization whose needs cannot take part cannot either (it would do nothing)
        changed = False
        for n in list(stack):
            missing = [m for m in by_name[n].needs if m not in stack]
            if missing:
                stack.remove(n)
                skipped[n] = [f"needs {', '.join(missing)}, which cannot take part in this run"]
                changed = True
    bad = [n for n in order_l if n not in stack]
    if bad:
        why = "; ".join(n + ": " + skipped.get(n, ["?"])[0] for n in bad)
        raise WorkloadError(f"--order names {', '.join(bad)}, which cannot take part in this run ({why})")
    seq = order_l + [n for n in stack if n not in order_l]
    for i, n in enumerate(seq):
        late = [m for m in by_name[n].needs if m in seq[i + 1 :]]
        if late:
            raise WorkloadError(f"--order puts {n} before {', '.join(late)}, which it needs")

    def needed(n: str) -> set[str]:
        """What ``n`` needs, transitively."""
        out: set[str] = set()
        todo = list(by_name[n].needs)
        while todo:
            m = todo.pop()
            if m not in out:
                out.add(m)
                todo.extend(by_name[m].needs)
        return out

    def reg(names: list[str] | tuple[str, ...]) -> tuple[str, ...]:
        return tuple(n for n in valid if n in set(names))

    configs: list[Config] = []
    by_set: dict[tuple[str, ...], str] = {}

    def add(cid: str, label: str, opts: tuple[str, ...], role: str) -> str:
        if opts in by_set:
            return by_set[opts]
        configs.append(Config(cid, label, opts, role))
        by_set[opts] = cid
        return cid

    full = reg(stack)
    stock_id = add("stock", "stock (no optimization)", (), "stock")
    full_id = add("full", "full stack", full, "full") if full else stock_id
    comparisons: list[Comparison] = []
    if workload.mode == "leave-one-out":
        for n in seq:
            deps = [m for m in stack if n in needed(m)]  # they need it, transitively
            label = f"full - {n}" + (f" (and {', '.join(deps)}, which need it)" if deps else "")
            without = add(f"loo_{n}", label, reg([m for m in stack if m != n and m not in deps]), "leave-one-out")
            comparisons.append(Comparison(n, full_id, without))
    elif workload.mode == "cumulative":
        prev = stock_id
        for k in range(1, len(seq) + 1):
            opts = reg(seq[:k])
            cid = add(f"cum{k}_{seq[k - 1]}", "stock + " + " + ".join(seq[:k]), opts, "cumulative")
            comparisons.append(Comparison(seq[k - 1], cid, prev))
            prev = cid
    elif workload.mode == "single":
        for n in seq:
            base = reg(sorted(needed(n)))
            cid = add(f"single_{n}", "stock + " + " + ".join([*base, n]), reg([*base, n]), "single")
            without = add(f"base_{n}", "stock + " + " + ".join(base), base, "single") if base else stock_id
            comparisons.append(Comparison(n, cid, without))
    if full:
        # The control: deliberately a duplicate of the full stack, in its own process.
        configs.append(Config("full_ctrl", "full stack (control)", full, "control"))
    if workload.vs_unquantized:
        # Information: stock as it would run without the quantization, interleaved with the others like them.
        quant = workload.od_config.get(QUANTIZATION_KEY)
        label = f"stock without quantization_config={quant!r} (information, no verdict)"
        configs.append(Config(UNQUANTIZED, label, (), INFORMATION, od_drop=(QUANTIZATION_KEY,)))

    notes = []
    eng = engine or workload.engine
    if eng == "auto":
        eng = "testbed" if workload.is_tiny else ("omni" if accelerator_visible() else "testbed")
        if eng == "testbed" and not workload.is_tiny:
            notes.append(
                "no accelerator is visible: this checkpoint would run on CPU in the test-bed engine (vLLM-Omni's "
                "Omni engine needs an accelerator platform)"
            )
    sched = workload.schedule if workload.schedule != "auto" else "resident" if workload.is_tiny else "per-round"
    if eng in ("omni", "serve") and not accelerator_visible():
        notes.append(
            f"no accelerator is visible: the {eng} engine runs vLLM-Omni on CPU through the test bed's CPU runtime "
            "(testbed/runtime.py); fine for the tiny model, far too slow for a real checkpoint"
        )
    return Plan(
        workload=workload,
        configs=configs,
        comparisons=comparisons,
        stack=list(seq),
        skipped=skipped,
        opts=by_name,
        engine=eng,
        schedule=sched,
        extra_imports=list(extra_imports or []),
        notes=notes,
    )


def accelerator_visible() -> bool:
    from vllm_omni_ascend_opt import _backend

    if _backend.torch_npu_module() is not None:
        return True
    import torch

    return bool(torch.cuda.is_available())


#: Rough constants behind ``plan``'s estimate, in seconds (an order of magnitude, not a measurement): a worker's
#: start and image cost for the tiny model on a 2-core CPU, and for Qwen-Image on one Ascend 910B1.
TINY_START_S = 12.0
TINY_IMAGE_S_PER_MPIX_STEP = 0.06 / (64 * 64 / 1e6 * 4)
TINY_IMAGE_FIXED_S = 0.02
REAL_START_S = 120.0
REAL_IMAGE_S_PER_MPIX_STEP = 3.1 / (1280 * 704 / 1e6 * 8)


@dataclass
class Estimate:
    processes: int
    generations: int
    measured: int
    seconds: float
    assumptions: str


def estimate(plan: Plan) -> Estimate:
    wl = plan.workload
    n = len(plan.configs)
    mpix_steps = wl.height * wl.width / 1e6 * wl.steps * (2.0 if wl.cfg_scale > 1 else 1.0)
    if wl.is_tiny:
        start, image = TINY_START_S, TINY_IMAGE_FIXED_S + TINY_IMAGE_S_PER_MPIX_STEP * mpix_steps
        basis = "tiny model on a 2-core CPU"
    else:
        start, image = REAL_START_S, REAL_IMAGE_S_PER_MPIX_STEP * mpix_steps
        basis = "Qwen-Image on one Ascend 910B1 (BF16 eager); process start assumed 120 s"
    measured = n * wl.repeats * len(plan.samples)
    if plan.schedule == "resident":
        sets = max(1, min(wl.process_sets, wl.repeats))
        processes, starts = n * sets, sets * math.ceil(n / max(1, wl.start_jobs))
    else:
        processes = starts = n * wl.repeats
    gens = processes * wl.warmup + measured
    secs = starts * start + gens * image
    return Estimate(
        processes, gens, measured, secs, f"rough: {basis}; start {start:.0f} s/process, {image:.2f} s/image"
    )
