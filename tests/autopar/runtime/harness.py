"""Multi-rank test harness: spawn N gloo ranks, run configs, compare with one process.

In: a world size and a list of `Case`s (zoo or Hugging Face preset, or a user's own factory
with its data hook and loss; ParallelConfig, global batch, optional placements; pp > 1:
optional stage boundaries and a schedule override). Out: per case the per-step (loss, pre-clip
grad norm) of every rank, and the same for the single-process reference
(`autopar.runtime.trainer.reference_run`), run once per model.

One spawn per world size runs all its cases, because starting processes is the slow part on
a shared 2-core machine; each spawn takes a free port (bound to port 0) so concurrent test
runs do not collide. `run_groups` spawns replica groups (each its own world) the same way;
`run_group_jobs` starts two groups of ft_job.py each under its own torchrun, for the tests that
kill and restart one.
"""

from __future__ import annotations

import datetime
import faulthandler
import json
import multiprocessing
import os
import pickle
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

from autopar.config import ParallelConfig
from autopar.estimate.memory import expert_replicas
from autopar.models.source import HF_FACTORY, ZOO_FACTORY
from autopar.runtime.expert_parallel import is_moe_block
from autopar.runtime.mesh import free_port, rank_environment
from autopar.runtime.parallelize import pipeline_tp_plan
from autopar.runtime.task import task_from_source
from autopar.runtime.tensor_parallel import tp_plan
from autopar.runtime.trainer import TrainOptions, reference_run, train

HERE = Path(__file__).resolve().parent
# no collective of these tiny models waits minutes, even at a load of 10 on 2 cores
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=5)
# a spawn's ranks all done within this, or its test fails with each rank's stack: the
# collective timeout above holds for the default group and the runtime's mesh groups
# (`mesh.collective_timeout`), but a group made otherwise gets torch's own 30 minutes
# (`new_group`'s default), and a rank can hang outside a collective; either would hold a CI
# worker, then say nothing of where the ranks stood. The longest spawn takes about 2 min.
RANKS_DEADLINE_S = 15 * 60
OPTIONS = TrainOptions(steps=3, lr=1e-3, weight_decay=0.1, max_grad_norm=1.0, log=False)


@dataclass(frozen=True)
class Case:
    model: str  # zoo preset
    config: ParallelConfig
    global_batch_size: int = 4
    placements: dict | None = None
    overrides: dict = field(default_factory=dict)
    stage_layers: tuple[tuple[str, ...], ...] | None = None  # pp > 1; None: the even split
    schedule: str | None = None  # a pipeline.SCHEDULES name the config cannot say ("zbv")
    seq_len: int | None = None  # Hugging Face presets (`*-hf`) need one
    factory: str | None = None  # "module:fn", the user's own (then `model` is a label)
    data: str | None = None  # the factory's data hook ("module:fn"); None: token ids
    loss: str | None = None  # the factory's loss ("module:fn"); None: next-token
    roles: dict | None = None  # `Plan.tensor_parallel_roles`: linears split by the trace
    # the training precision: "bf16" runs autocast over fp32 parameters, FSDP2 in bf16
    precision: str = "fp32"
    # the plan's parameter bytes per pipeline stage (`Plan.stages[i].memory_bytes`), which
    # `check_cases` holds the ranks' own against (`check_parameter_bytes`)
    planned_params: tuple[float, ...] | None = None

    @property
    def label(self) -> str:
        extra = " +placements" if self.placements else ""
        extra += " uneven" if self.stage_layers else ""
        extra += f" {self.schedule}" if self.schedule else ""
        extra += f" {self.precision}" if self.precision != "fp32" else ""
        return f"{self.model} {self.config.as_text()}{extra}"


def task_of(case: Case):
    if case.factory is not None:
        return task_from_source(
            case.factory,
            case.overrides,
            global_batch_size=case.global_batch_size,
            seq_len=case.seq_len,
            data=case.data,
            loss=case.loss,
        )
    return task_from_source(
        HF_FACTORY if case.model.endswith("-hf") else ZOO_FACTORY,
        {"name": case.model, **case.overrides},
        global_batch_size=case.global_batch_size,
        seq_len=case.seq_len,
    )


def tp_of(case: Case) -> dict[str, str] | None:
    """The TP plan of a case whose plan split projections by the trace (``roles``), as the
    generated program spells it out; None: the trainer derives it (names, placements)."""
    if not case.roles:
        return None
    c = case.config
    model = task_of(case).build()
    if c.pp > 1:
        layers = case.stage_layers
        return pipeline_tp_plan(model, c, case.placements, layers, case.schedule, case.roles)
    return tp_plan(model, c, case.placements, roles=case.roles, vocab_parallel=c.cp == 1)


def _entry(
    rank: int,
    world_size: int,
    port: int,
    fn: Any,
    args: tuple,
    out_dir: str,
    timeout: datetime.timedelta = COLLECTIVE_TIMEOUT,
) -> None:
    _dump_stack_on_signal(out_dir, rank)
    os.environ.update(rank_environment(rank, world_size, port))
    torch.set_num_threads(1)
    import torch.distributed as dist

    # a file store in this run's own directory: a free TCP port found beforehand can be taken
    # by a test on another pytest-xdist worker before rank 0 listens on it (EADDRINUSE)
    store = f"file://{Path(out_dir, 'store')}"
    # a rank stuck in a collective (a plan the ranks disagree on) fails its test after
    # COLLECTIVE_TIMEOUT, with gloo's message naming the op, not after gloo's 30 minutes
    dist.init_process_group(
        "gloo", init_method=store, rank=rank, world_size=world_size, timeout=timeout
    )
    try:
        result = fn(*args)
    finally:
        dist.destroy_process_group()
    Path(out_dir, f"rank{rank}.pkl").write_bytes(pickle.dumps(result))


# Ranks fork from a server process (one per pytest worker) that imported torch and the
# runtime once: a spawned rank spends about 3.5 s of CPU importing them, and the suite starts
# a few hundred ranks on 2 cores. The server runs no torch op, so no thread pool is forked.
# torch's pipelining (and torch._dynamo with it, which torch.export needs too) is preloaded
# as well: the runtime imports it only when a pipeline is built, and many ranks here build
# one or trace. So is transformers' modeling core, which every rank building a Hugging Face
# model imported afresh (about 1.9 s of CPU: scipy, torchao, accelerate and more come with
# it); each family's own modeling module is still imported where it is built.
# AUTOPAR_TEST_START_METHOD=spawn starts every rank afresh instead.
_PRELOAD = [
    "torch",
    "torch.distributed",
    "torch.distributed.pipelining",
    "autopar.runtime.trainer",
    "transformers.modeling_utils",
    "harness",
]
_START_METHOD = os.environ.get("AUTOPAR_TEST_START_METHOD", "forkserver")
if _START_METHOD == "forkserver":  # read when the server starts, by the first run_ranks
    multiprocessing.get_context("forkserver").set_forkserver_preload(_PRELOAD)


def run_ranks(
    world_size: int,
    fn: Any,
    *args: Any,
    deadline_s: float = RANKS_DEADLINE_S,
    collective_timeout: datetime.timedelta = COLLECTIVE_TIMEOUT,
) -> list[Any]:
    """Run ``fn(*args)`` on ``world_size`` gloo ranks (forked from a server that has imported
    torch and autopar's runtime); their return values by rank. Ranks still running after
    ``deadline_s`` fail the test with their stacks (`_join_by_deadline`); the default group's
    collectives wait ``collective_timeout`` for their peers."""
    with tempfile.TemporaryDirectory() as tmp:
        context = mp.start_processes(
            _entry,
            args=(world_size, free_port(), fn, args, tmp, collective_timeout),
            nprocs=world_size,
            join=False,
            start_method=_START_METHOD,
        )
        _join_by_deadline(context, tmp, deadline_s)
        return [pickle.loads(Path(tmp, f"rank{r}.pkl").read_bytes()) for r in range(world_size)]


def _dump_stack_on_signal(out_dir: str, rank: int) -> None:
    """A crash (SIGSEGV) prints where into the test's stderr; SIGUSR1 (`_join_by_deadline`)
    writes every thread's stack to ``out_dir``/stack{rank}.txt, which the test reports:
    a rank forked from the server writes to the server's stderr, which no test captures."""
    faulthandler.enable()
    stacks = open(Path(out_dir, f"stack{rank}.txt"), "w")  # noqa: SIM115 (open for the rank's life)
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)


def _join_by_deadline(context: Any, out_dir: str, deadline_s: float = RANKS_DEADLINE_S) -> None:
    """Join the ranks of ``context`` (`mp.start_processes`, join=False) as `join=True` would,
    raising the first rank's error; past ``deadline_s``, each rank still running writes its
    stacks, is killed, and the test fails with them. (Not `faulthandler.dump_traceback_later`
    in each rank: the first rank it ends makes torch's join kill the others, which may not
    have written theirs yet.)"""
    end = time.monotonic() + deadline_s
    while not context.join(timeout=1):
        if time.monotonic() < end:
            continue
        alive = [(r, p) for r, p in enumerate(context.processes) if p.is_alive()]
        for _, p in alive:
            os.kill(p.pid, signal.SIGUSR1)
        time.sleep(2)
        for _, p in alive:
            p.kill()
            p.join()
        stacks = "\n".join(
            f"rank {r}:\n{Path(out_dir, f'stack{r}.txt').read_text()[-4000:]}" for r, _ in alive
        )
        raise AssertionError(
            f"ranks {[r for r, _ in alive]} still running after {deadline_s:.0f} s (a deadlock?);"
            f" where each stood:\n{stacks}"
        )


def run_cases(cases: list[Case]) -> list[list[tuple[float, float]]]:
    """On one rank: train every case; per case per step (loss, grad_norm)."""
    return [[(r.loss, r.grad_norm) for r in steps] for steps in _train_cases(cases)]


def run_cases_and_parameters(cases: list[Case]) -> list[tuple[list[tuple[float, float]], float]]:
    """On one rank: train every case; per case its steps' (loss, grad_norm) and the rank's
    parameter bytes after its last step."""
    return [
        ([(r.loss, r.grad_norm) for r in steps], steps[-1].memory_bytes["parameters"])
        for steps in _train_cases(cases)
    ]


def _train_cases(cases: list[Case]) -> list[list]:
    out = []
    for case in cases:
        steps = train(
            task_of(case),
            case.config,
            case.global_batch_size,
            options=OPTIONS,
            placements=case.placements,
            tp=tp_of(case),
            stage_layers=case.stage_layers,
            schedule=case.schedule,
        )
        out.append(steps)
    return out


def reference(case: Case) -> list[tuple[float, float]]:
    torch.set_num_threads(1)
    return [
        (r.loss, r.grad_norm) for r in reference_run(task_of(case), case.global_batch_size, OPTIONS)
    ]


def max_rel_error(got: list[tuple[float, float]], want: list[tuple[float, float]]) -> float:
    return max(
        abs(g - w) / abs(w)
        for gs, ws in zip(got, want, strict=True)
        for g, w in zip(gs, ws, strict=True)
    )


# a stage's parameter bytes, the mean over its ranks, against the plan's: FSDP2 cuts a tensor's
# first dimension in ceil-sized chunks, so one rank may hold a few rows more than another, but
# a stage's ranks together hold its parameters as many times as they are replicated
PARAM_RTOL = 0.01


def _resident(case: Case, planned: float) -> float:
    """The parameter bytes a rank keeps between steps of the plan's ``planned``: ZeRO-1/2 over
    FSDP2 prices the parameters whole (as DeepSpeed keeps them), and FSDP2 keeps only its
    shards (autopar/runtime/data_parallel.py's docstring): the dense ones over fsdp, the
    experts over the ranks holding the same ones (none where ep spans every data rank)."""
    c = case.config
    if c.fsdp == 1 or c.zero_stage not in (1, 2):
        return planned
    experts = _expert_bytes(case) / c.ep if c.ep > 1 and c.pp == 1 else 0.0
    return (planned - experts) / c.fsdp + experts / expert_replicas(c)


def _expert_bytes(case: Case) -> float:
    """The bytes of the model's experts (every MoE layer's experts, on meta)."""
    model = task_of(case).build_meta()
    stacks = [m.experts if hasattr(m, "dispatch") else m for m in model.modules()
              if is_moe_block(m)]  # fmt: skip
    return sum(p.numel() * p.element_size() for s in stacks for p in s.parameters())


def check_parameter_bytes(case: Case, measured: list[float]) -> list[str]:
    """``measured``: each rank's parameter bytes; per pipeline stage (the mesh's outermost
    axis; under interleaving a rank holds stages r, r + pp, ...), the mean over its ranks
    against the plan's. The stages that differ, each as a line; none without a plan's."""
    if case.planned_params is None:
        return []
    c = case.config
    pp, per_stage = c.pp, len(measured) // c.pp
    out = []
    for stage in range(pp):
        ranks = measured[stage * per_stage : (stage + 1) * per_stage]
        mean = sum(ranks) / len(ranks)
        planned = _resident(case, sum(case.planned_params[stage::pp]))
        if abs(mean - planned) > PARAM_RTOL * planned:
            out.append(
                f"{case.label}: stage {stage}'s ranks hold {mean:.0f} parameter bytes each "
                f"(mean of {[round(b) for b in ranks]}), the plan {planned:.0f}"
            )
    return out


def check_cases(
    world_size: int, cases: list[Case], rtol: float = 1e-5, report: bool = False
) -> dict[str, float]:
    """Run ``cases`` on ``world_size`` ranks; assert every rank matches the reference within
    ``rtol``, and each stage's parameter bytes its plan's (`check_parameter_bytes`); return
    the max relative error per case label. ``report``: print a parameter-bytes mismatch
    instead of failing on it."""
    ran = run_ranks(world_size, run_cases_and_parameters, cases)
    per_rank = [[steps for steps, _ in rank] for rank in ran]
    for i, case in enumerate(cases):
        for line in check_parameter_bytes(case, [rank[i][1] for rank in ran]):
            assert report, line
            print(f"PARAMETER BYTES {line}")
    errors, references = {}, {}
    for i, case in enumerate(cases):
        key = (case.model, case.factory, case.data, case.loss, repr(case.overrides),
               case.global_batch_size, case.seq_len)  # fmt: skip
        if key not in references:  # many cases share a model: one reference each
            references[key] = reference(case)
        want = references[key]
        err = max(max_rel_error(results[i], want) for results in per_rank)
        errors[case.label] = err
        print(f"{case.label}: max relative error {err:.1e}")
        assert err <= rtol, (
            f"{case.label}: max relative error {err:.2e} > {rtol}: {per_rank[0][i]} vs {want}"
        )
    return errors


def _group_entry(
    rank: int, group_size: int, ports: list[int], fn: Any, args: tuple, out_dir: str
) -> None:
    """A rank of one of several independent worlds (replica groups): world ``rank //
    group_size`` on ``ports[world]``, a TCP store (torchft's Manager reads MASTER_ADDR and
    MASTER_PORT to meet its group there)."""
    _dump_stack_on_signal(out_dir, rank)
    group, local = divmod(rank, group_size)
    os.environ.update(rank_environment(local, group_size, ports[group]))
    torch.set_num_threads(1)
    import torch.distributed as dist

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{ports[group]}",
        rank=local,
        world_size=group_size,
        timeout=COLLECTIVE_TIMEOUT,
    )
    try:
        result = fn(group, *args)
    finally:
        dist.destroy_process_group()
    Path(out_dir, f"rank{rank}.pkl").write_bytes(pickle.dumps(result))


def run_groups(groups: int, group_size: int, fn: Any, *args: Any) -> list[Any]:
    """Run ``fn(group, *args)`` on ``groups`` separate gloo worlds of ``group_size`` ranks
    each (DiLoCo's replica groups); the return values by global rank (group-major)."""
    with tempfile.TemporaryDirectory() as tmp:
        ports = [free_port() for _ in range(groups)]
        context = mp.start_processes(
            _group_entry,
            args=(group_size, ports, fn, args, tmp),
            nprocs=groups * group_size,
            join=False,
            start_method=_START_METHOD,
        )
        _join_by_deadline(context, tmp)
        n = groups * group_size
        return [pickle.loads(Path(tmp, f"rank{r}.pkl").read_bytes()) for r in range(n)]


def run_group_jobs(min_replicas: int, job) -> list[str]:
    """Both groups of ft_job.py (fault-tolerant or DiLoCo replica groups), each its own torchrun
    of two ranks, through a lighthouse in this process that forms a quorum of ``min_replicas``
    groups; ``job(url)``: torchrun's arguments from the script on ("{group}" becomes the
    group's index). Returns each group's log, after checking both ended well."""
    torchft = pytest.importorskip("torchft._torchft")
    lighthouse = torchft.LighthouseServer(
        bind="[::]:0", min_replicas=min_replicas, join_timeout_ms=10000, quorum_tick_ms=100
    )
    env = dict(os.environ, PYTHONPATH=str(HERE), OMP_NUM_THREADS="1", RUST_LOG="error",
               TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")  # fmt: skip
    jobs = []
    try:
        for group in (0, 1):
            args = [a.replace("{group}", str(group)) for a in job(lighthouse.address())]
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   "--nproc-per-node=2", *args]  # fmt: skip
            jobs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE,
                                         stderr=subprocess.STDOUT, text=True))  # fmt: skip
        logs = [job.communicate(timeout=600)[0] for job in jobs]
    finally:
        for job in jobs:
            job.kill()
        lighthouse.shutdown()
    assert [job.returncode for job in jobs] == [0, 0], logs[1][-3000:]
    return logs


def job_steps(out: Path) -> tuple[list[list[int]], list[list[int]], dict]:
    """What ft_job.py's ranks wrote under ``out``: the steps each of group 0's ranks committed,
    the same for group 1's ranks after its restart (not the killed process's), and every
    (group, rank, pid) record."""
    killed = int((out / "killed").read_text())
    records = {}
    for f in out.glob("g*r*p*.json"):
        g, r, pid = map(int, re.match(r"g(\d)r(\d)p(\d+)", f.stem).groups())
        records[(g, r, pid)] = json.loads(f.read_text())["steps"]
    group0 = [steps for (g, _, _), steps in records.items() if g == 0]
    group1 = [steps for (g, _, pid), steps in records.items() if g == 1 and pid != killed]
    return group0, group1, records
