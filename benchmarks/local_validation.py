"""Predicted vs measured step time of many plans of one model on the local CPU ranks.

    python3 benchmarks/local_validation.py                 # 2 and 4 ranks, ~9 minutes
    python3 benchmarks/local_validation.py --quick         # plain DP/FSDP/TP/PP + the plan
    python3 benchmarks/local_validation.py --all --world-sizes 2 --json out.json
    python3 benchmarks/local_validation.py --world-sizes 4 --config "dp=2 pp=2 | mbs=1 1f1b"
    python3 benchmarks/local_validation.py --profile fresh     # profile this machine first

In: a Llama-style zoo model (`llama-tiny` with `OVERRIDES`: 4 blocks, hidden 256, GQA 8/4
heads, sequence 128, vocabulary 2048; fp32, AdamW), a global batch of 8 sequences, the
`local_cpu` profile on N ranks (`Cluster.from_profile("local_cpu", num_devices=N)`).
Per world size:
  1. every config of the search space (`autopar.solve.space` degree and inner choices) is
     priced with `autopar.evaluate` (the planner's own cost options); those that fit are the
     candidates. The default selection runs the 10 fastest predicted, the fastest of every
     (degrees, ZeRO stage), plain DP, FSDP (ZeRO-3), TP+SP and PP at the smallest and largest
     micro-batch, and the planner's choice (`autopar.parallelize` on the same model, cluster
     and batch); `--all` runs every candidate, `--quick` plain DP, FSDP, TP, PP and the plan,
     `--config TEXT` (repeatable, `ParallelConfig.as_text()` or the CLI's short form) the
     given configs and the plan.
  2. each config's program is written by `plan.save` and run for WARMUP + STEPS steps,
     REPEATS times (`local_runner`: rounds over all configs, so a change in machine load
     falls on every config alike); measured = median over repeats (3 by default: one repeat
     slowed by another process does not move it) of the median post-warm-up step; spread =
     (max - min) / median of the repeats.
  3. the table (predicted, measured, error = predicted / measured - 1, spread), and the
     three figures: median |error| (target <= 10%), Spearman rank correlation of predicted
     and measured (target >= 0.8), and the planner's choice measured against the measured
     best (target: within 5%), issue 46's targets (`TARGETS`).

Profile: ``--profile fresh`` first measures this machine with ``autopar profile`` (2 ranks,
about 90 s) and prices against that. The default, ``auto``, prices against the shipped
``local_cpu`` where that was measured on this machine's CPU model and a second's probe of a
few ops (launch, fp32 and bf16 matmul, a copy: `autopar.profiler.check`) agrees with its prices
within 1.5x, and measures afresh where not: machines of "this kind" come with an AMD EPYC or
an Intel Xeon, whose rates differ (on 2026-11-29 a Xeon ran the configs 26% and 43% off the
EPYC profile's prices in the median), two EPYCs of one name can be a Zen 3 and a Zen 4 (on
2026-12-01 the Zen 3 measured every config about twice its price), and one CPU drifts from day
to day too (on 2026-11-26 an EPYC measured 41% less memory bandwidth and 2.5x the per-layer
host time of the shipped profile).

Threads: every rank computes with one intra-op thread (`--threads`), as `autopar profile`
measured the per-rank rates of hardware_profiles/local_cpu.toml; on this 2-core machine 4
ranks share the cores, which the profile's compute_slots tells the cost model.
The load average is printed before, after and with each repeat: measure on an otherwise idle
machine (`--max-load 2.5` waits for one); with other processes on the cores the ranks slow
down unevenly and the figures say more about the load than about the cost model.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from local_runner import Measured, Program, measure  # noqa: E402

MODEL = "llama-tiny"
OVERRIDES = dict(
    vocab_size=2048, seq_len=128, num_layers=4, hidden=256, ffn_hidden=688, num_heads=8,
    num_kv_heads=4,
)  # fmt: skip
GLOBAL_BATCH = 8
PROFILE = "local_cpu"
# issue 46's acceptance (issue 17 asked for 20% and 10%)
TARGETS = {"error": 0.10, "spearman": 0.8, "pick": 0.05}


@dataclass(frozen=True)
class Settings:
    world_sizes: tuple[int, ...] = (2, 4)
    selection: str = "default"  # "default", "all", "quick", "asked" (the plan and `configs`)
    configs: tuple[str, ...] = ()
    top: int = 10
    warmup: int = 2
    steps: int = 3
    repeats: int = 3  # the median of three outlasts one repeat another process slowed
    threads: int = 1
    launcher: str = "pool"
    profile: str = PROFILE
    # before each repeat, wait (up to wait_s) for the 1-minute load average to fall below
    # this: other processes on the 2 cores slow the ranks down unevenly (0: do not wait)
    max_load: float = 0.0
    wait_s: float = 600.0


@dataclass(frozen=True)
class Row:
    world_size: int
    config: str
    why: str  # why it was selected
    predicted_s: float
    repeats_s: tuple[float, ...]  # one figure per repeat: median post-warm-up step
    error: str | None = None

    @property
    def label(self) -> str:
        return short_label(self.config)

    @property
    def measured_s(self) -> float:
        return statistics.median(self.repeats_s)

    @property
    def spread(self) -> float:
        return (max(self.repeats_s) - min(self.repeats_s)) / self.measured_s

    @property
    def rel_error(self) -> float:
        return self.predicted_s / self.measured_s - 1


def short_label(config_text: str) -> str:
    """`ParallelConfig.as_text()` in a few words: the degrees above 1 and what differs from
    the defaults (`dp=1 fsdp=2 ... | zero=3 mbs=4 1f1b recompute=none` -> `fsdp2 z3 mbs4`)."""
    degrees, _, rest = config_text.partition("|")
    words = [k + v for k, v in (w.split("=") for w in degrees.split()) if v != "1"]
    pp = "pp" in "".join(words)
    for w in rest.split():
        key, _, value = w.partition("=")
        if key == "zero" and value != "0":
            words.append("z" + value)
        elif key == "mbs":
            words.append(w.replace("=", ""))
        elif key == "recompute" and value != "none":
            words.append("rc-" + value)
        elif key == "v":
            words.append("v" + value)
        elif w == "+sp":
            words.append("sp")
        elif not value and pp:  # the schedule (and its virtual stages)
            words.append(w)
    return " ".join(words) or "single"


# ---------------------------------------------------------------- candidates


def candidates(world_size: int, settings: Settings, graph, model) -> tuple[list, object]:
    """(every fitting config's Plan, sorted by predicted step time; the planner's Plan)."""
    import autopar
    from autopar.errors import AutoparError
    from autopar.solve import PlanOptions
    from autopar.solve.limits import space_limits
    from autopar.solve.space import degree_choices, inner_choices

    cluster = autopar.Cluster.from_profile(settings.profile, num_devices=world_size)
    options = PlanOptions(sensitivity=False)
    kwargs = dict(graph=graph, global_batch_size=GLOBAL_BATCH, precision="fp32")
    limits = space_limits(model, graph, cluster, GLOBAL_BATCH, options.micro_batch_sizes)
    plans = []
    for degrees in degree_choices(limits):
        for cfg in inner_choices(limits, degrees):
            try:
                plan = autopar.evaluate(model, cluster, cfg, options=options.cost, **kwargs)
            except AutoparError:
                continue
            if plan.fits:
                plans.append(plan)
    plans.sort(key=lambda p: (p.step_time_s, p.config.as_text()))
    chosen = autopar.parallelize(model, cluster, options=options, **kwargs)
    return plans, chosen


def priced(world_size: int, settings: Settings, graph, model) -> list:
    """The Plans of the configs given with --config (`autopar.evaluate`, the planner's cost
    options), in the order given."""
    import autopar
    from autopar.config.text import parse_config
    from autopar.solve import PlanOptions

    cluster = autopar.Cluster.from_profile(settings.profile, num_devices=world_size)
    options = PlanOptions(sensitivity=False).cost
    return [
        autopar.evaluate(
            model, cluster, parse_config(text), graph=graph, global_batch_size=GLOBAL_BATCH,
            precision="fp32", options=options,
        )
        for text in settings.configs
    ]  # fmt: skip


def select(plans: list, chosen, settings: Settings, asked: list = ()) -> list[tuple[object, str]]:
    """(plan, why) pairs to run, each config once (module docstring, step 1)."""
    picked: dict[str, tuple[object, str]] = {}

    def add(plan, why: str) -> None:
        key = plan.config.as_text()
        if key in picked:
            picked[key] = (picked[key][0], picked[key][1] + "," + why)
        else:
            picked[key] = (plan, why)

    by_text = {p.config.as_text(): p for p in plans}
    add(by_text.get(chosen.config.as_text(), chosen), "plan")
    if settings.selection == "asked":
        for plan in asked:
            add(plan, "asked")
        return list(picked.values())
    for plan in _plain(plans, smallest_and_largest=settings.selection != "quick"):
        add(plan, "plain")
    if settings.selection == "quick":
        return list(picked.values())
    if settings.selection == "all":
        for plan in plans:
            add(plan, "all")
        return list(picked.values())
    for plan in plans[: settings.top]:
        add(plan, "top")
    seen: set[tuple] = set()
    for plan in plans:  # sorted: the first of each group is its fastest
        c = plan.config
        group = (c.dp, c.fsdp, c.cp, c.tp, c.pp, c.ep, c.zero_stage)
        if group not in seen:
            seen.add(group)
            add(plan, "group")
    return list(picked.values())


def _plain(plans: list, smallest_and_largest: bool) -> list:
    """Plain DP, FSDP (ZeRO-3), TP (+SP), PP (GPipe, 1F1B where it runs) over all ranks, no
    recompute, at the smallest micro-batch (and the largest)."""
    out = []
    for kind in ("dp", "fsdp", "tp", "pp"):
        mine = [p for p in plans if _is_plain(p.config, kind)]
        if not mine:
            continue
        by_mbs = sorted(mine, key=lambda p: (p.config.micro_batch_size, p.step_time_s))
        out.append(by_mbs[0])
        if smallest_and_largest:
            out.append(max(mine, key=lambda p: (p.config.micro_batch_size, -p.step_time_s)))
    return out


def _is_plain(c, kind: str) -> bool:
    world = c.world_size
    if getattr(c, kind) != world or c.recompute != "none":
        return False
    if kind == "fsdp":
        return c.zero_stage == 3
    if kind == "tp":
        return c.sequence_parallel
    if kind == "pp":
        return c.schedule in ("gpipe", "1f1b") and c.virtual_stages == 1
    return True


# ---------------------------------------------------------------- measuring


def run(settings: Settings, out_json: str | None = None) -> list[Row]:
    import torch

    import autopar
    from autopar.models import zoo

    torch.set_num_threads(settings.threads)
    model = zoo.build(MODEL, device="meta", **OVERRIDES)
    inputs, _ = zoo.example_batch(MODEL, model)
    graph = autopar.trace(model, inputs)
    rows: list[Row] = []
    chosen_by_world: dict[int, str] = {}
    with tempfile.TemporaryDirectory(prefix="autopar-validation-") as tmp:
        for world in settings.world_sizes:
            t0 = time.perf_counter()
            plans, chosen = candidates(world, settings, graph, model)
            chosen_by_world[world] = chosen.config.as_text()
            picked = select(plans, chosen, settings, priced(world, settings, graph, model))
            programs = []
            for i, (plan, _why) in enumerate(picked):
                directory = Path(tmp, f"w{world}_{i:03d}")
                plan.save(directory)
                programs.append(Program(plan.config.as_text(), str(directory)))
            print(
                f"[{world} ranks] {len(plans)} configs fit; running {len(programs)} "
                f"({time.perf_counter() - t0:.1f} s to price and write them); load "
                f"{_load()}",
                flush=True,
            )
            rounds: list[dict[str, Measured]] = []
            for r in range(settings.repeats):
                _wait_for_quiet(settings)
                t1 = time.perf_counter()
                rounds.append(
                    measure(
                        world,
                        programs,
                        steps=settings.warmup + settings.steps,
                        threads=settings.threads,
                        launcher=settings.launcher,
                    )
                )
                print(
                    f"[{world} ranks] repeat {r + 1}/{settings.repeats}: "
                    f"{time.perf_counter() - t1:.0f} s; load {_load()}",
                    flush=True,
                )
            for plan, why in picked:
                rows.append(
                    _row(world, plan, why, [m[plan.config.as_text()] for m in rounds], settings)
                )
    report(rows, chosen_by_world)
    if out_json:
        data = {
            "settings": settings.__dict__,
            "model": {"name": MODEL, **OVERRIDES, "global_batch": GLOBAL_BATCH},
            "chosen": chosen_by_world,
            "rows": [r.__dict__ for r in rows],
            "load_after": _load(),
        }
        Path(out_json).write_text(json.dumps(data, indent=1, default=list))
    return rows


def _row(world: int, plan, why: str, got: list[Measured], settings: Settings) -> Row:
    errors = [m.error for m in got if not m.ok]
    per_repeat = tuple(statistics.median(m.step_times_s[settings.warmup :]) for m in got if m.ok)
    error = errors[0] if errors else None
    return Row(world, plan.config.as_text(), why, plan.step_time_s, per_repeat, error)


def _wait_for_quiet(settings: Settings) -> None:
    if settings.max_load <= 0:
        return
    deadline = time.monotonic() + settings.wait_s
    while os.getloadavg()[0] > settings.max_load and time.monotonic() < deadline:
        time.sleep(5)
    if os.getloadavg()[0] > settings.max_load:
        print(f"load {_load()} still above {settings.max_load}: measuring anyway", flush=True)


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


# ---------------------------------------------------------------- figures


def spearman(xs: list[float], ys: list[float]) -> float:
    """Spearman's rank correlation: Pearson's of the ranks (ties get their mean rank)."""
    import numpy as np

    def ranks(v: list[float]) -> np.ndarray:
        a = np.asarray(v, dtype=float)
        order = a.argsort(kind="stable")
        r = np.empty(len(a))
        r[order] = np.arange(len(a), dtype=float)
        for value in np.unique(a):  # ties: mean rank
            tie = a == value
            r[tie] = r[tie].mean()
        return r

    if len(xs) < 2:
        return float("nan")
    rx, ry = ranks(xs), ranks(ys)
    if rx.std() == 0 or ry.std() == 0:
        return float("nan")
    return float(np.corrcoef(rx, ry)[0, 1])


@dataclass(frozen=True)
class Figures:
    num_configs: int
    median_abs_error: float
    spearman: float
    chosen: str
    chosen_over_best: float | None  # chosen measured / best measured - 1


def figures(rows: list[Row], chosen: str) -> Figures:
    ok = [r for r in rows if r.error is None and r.repeats_s]
    errs = [abs(r.rel_error) for r in ok]
    rho = spearman([r.predicted_s for r in ok], [r.measured_s for r in ok])
    best = min((r.measured_s for r in ok), default=float("nan"))
    mine = next((r for r in ok if r.config == chosen), None)
    over = mine.measured_s / best - 1 if mine else None
    med = statistics.median(errs) if errs else float("nan")
    return Figures(len(ok), med, rho, chosen, over)


def report(rows: list[Row], chosen_by_world: dict[int, str]) -> None:
    print()
    head = (
        f"{'N':>2} {'config':<34} {'why':<16} {'pred ms':>8} {'meas ms':>8} {'err':>7} "
        f"{'spread':>6}"
    )
    print(head)
    print("-" * len(head))
    for r in sorted(rows, key=lambda r: (r.world_size, r.measured_s if r.repeats_s else 1e9)):
        if r.error or not r.repeats_s:
            print(f"{r.world_size:>2} {r.label:<34} {r.why:<16} {r.predicted_s * 1e3:>8.1f} "
                  f"  not run: {r.error}")  # fmt: skip
            continue
        mark = " <- plan" if r.config == chosen_by_world.get(r.world_size) else ""
        print(
            f"{r.world_size:>2} {r.label:<34} {r.why:<16} {r.predicted_s * 1e3:>8.1f} "
            f"{r.measured_s * 1e3:>8.1f} {r.rel_error:>+7.1%} {r.spread:>6.1%}{mark}"
        )
    print()
    for world, chosen in chosen_by_world.items():
        _print_figures(
            f"{world} ranks", figures([r for r in rows if r.world_size == world], chosen)
        )
    spreads = [r.spread for r in rows if r.error is None and len(r.repeats_s) > 1]
    if spreads:
        print(
            f"spread over repeats: median {statistics.median(spreads):.1%}, max {max(spreads):.1%}"
        )


def _print_figures(label: str, f: Figures) -> None:
    over = "not measured" if f.chosen_over_best is None else f"{f.chosen_over_best:+.1%}"
    verdict = (
        f.median_abs_error <= TARGETS["error"],
        f.spearman >= TARGETS["spearman"],
        f.chosen_over_best is not None and f.chosen_over_best <= TARGETS["pick"],
    )
    ok = ["ok" if v else "MISS" for v in verdict]
    print(
        f"{label}: {f.num_configs} configs; median |error| {f.median_abs_error:.1%} "
        f"(<= {TARGETS['error']:.0%}: {ok[0]}); Spearman {f.spearman:.3f} "
        f"(>= {TARGETS['spearman']}: {ok[1]}); planner's choice {f.chosen} measures {over} vs "
        f"the best (<= {TARGETS['pick']:.0%}: {ok[2]})"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world-sizes", default="2,4", help="comma-separated rank counts")
    p.add_argument("--quick", action="store_true", help="plain DP/FSDP/TP/PP and the plan")
    p.add_argument("--all", action="store_true", help="every config that fits")
    p.add_argument(
        "--config",
        action="append",
        default=[],
        help="run this config (and the plan) only; repeatable",
    )
    p.add_argument("--top", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=3, help="timed steps after the warm-up")
    p.add_argument("--repeats", type=int, default=Settings.repeats)
    p.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    p.add_argument("--launcher", choices=("pool", "torchrun"), default="pool")
    p.add_argument(
        "--profile",
        default="auto",
        help="profile name or .toml path; 'fresh': measure this machine first (~90 s); "
        f"'auto' (default): {PROFILE} where it was measured on this machine's CPU, else fresh",
    )
    p.add_argument("--json", help="write the rows and figures here")
    p.add_argument(
        "--max-load",
        type=float,
        default=0.0,
        help="wait (up to --wait-s) for the 1-minute load average to drop below this",
    )
    p.add_argument("--wait-s", type=float, default=600.0)
    args = p.parse_args(argv)
    settings = Settings(
        world_sizes=tuple(int(x) for x in args.world_sizes.split(",")),
        selection="asked"
        if args.config
        else "quick"
        if args.quick
        else "all"
        if args.all
        else "default",
        configs=tuple(args.config),
        top=args.top,
        warmup=args.warmup,
        steps=args.steps,
        repeats=args.repeats,
        threads=args.threads,
        launcher=args.launcher,
        profile=args.profile,
        max_load=args.max_load,
        wait_s=args.wait_s,
    )
    os.environ["OMP_NUM_THREADS"] = str(settings.threads)
    print(f"load average before: {_load()}; {settings}", flush=True)
    if settings.profile == "auto":
        note = other_cpu_note(PROFILE) or probe_note(PROFILE)
        here = (
            f"{PROFILE} was measured on this machine's CPU and its probe agrees: pricing against it"
        )
        print(note or here, flush=True)
        settings = replace(settings, profile="fresh" if note else PROFILE)
    elif settings.profile != "fresh":
        note = other_cpu_note(settings.profile) or probe_note(settings.profile)
        print(note or f"{settings.profile}: the probe agrees with this machine", flush=True)
    if settings.profile == "fresh":
        _wait_for_quiet(settings)
        settings = replace(settings, profile=_fresh_profile(settings.world_sizes))
    t0 = time.perf_counter()
    run(settings, args.json)
    print(f"total {time.perf_counter() - t0:.0f} s; load average after: {_load()}")
    return 0


def other_cpu_note(profile_name: str) -> str | None:
    """A line saying a CPU profile was measured on another CPU than this machine's, whose
    rates then differ (on 2026-11-29, on a CPU of another kind, the shipped profile priced the
    runs 26% and 43% off in the median on 2 and 4 ranks), or None."""
    import autopar
    from autopar.profiler.run import cpu_model

    profile = autopar.load_profile(profile_name)
    here = cpu_model()
    if profile.kind != "cpu" or profile.device.name.startswith(here):
        return None
    measured = profile.device.name.rsplit(" rank", 1)[0]
    return (
        f"note: {profile.name} was measured on {measured}; this machine is {here}, whose "
        "rates differ: --profile fresh (what the default, auto, does here) measures this one"
    )


def probe_note(profile_name: str) -> str | None:
    """A line saying a CPU profile's prices are off on this machine now, timing a few ops
    (`autopar.profiler.check`): the CPU's name alone does not tell a virtual machine's Zen 3
    from a Zen 4 (on 2026-12-01 one measured every config about twice the shipped profile's
    price), or None. Each probe is printed."""
    import autopar
    from autopar.profiler.check import mismatch_note, probe_profile

    profile = autopar.load_profile(profile_name)
    if profile.kind != "cpu":
        return None
    probes = probe_profile(profile)
    for p in probes:
        print(f"  probe {p.as_text()}", flush=True)
    note = mismatch_note(profile, probes)
    return (
        note
        and f"note: {note}: --profile fresh (what the default, auto, does here) measures this one"
    )


def _fresh_profile(world_sizes: tuple[int, ...]) -> str:
    """A profile of this machine as it is now (`autopar profile`, 2 ranks of one thread, as
    the shipped local_cpu was measured), written to a temporary file; its path."""
    import subprocess

    path = Path(tempfile.mkdtemp(prefix="autopar-profile-")) / "local_cpu_now.toml"
    devices = max(8, *world_sizes)
    command = [sys.executable, "-m", "autopar", "profile", "--out", str(path), "--nproc", "2",
               "--node-devices", str(devices)]  # fmt: skip
    print(f"profiling this machine: {' '.join(command[1:])}", flush=True)
    t0 = time.perf_counter()
    subprocess.run(command, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    print(f"profiled in {time.perf_counter() - t0:.0f} s: {path}", flush=True)
    return str(path)


if __name__ == "__main__":
    sys.exit(main())
