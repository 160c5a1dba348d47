"""The driver: each public entry point is the phases called in order, one line each.

    trace        model, one sample           -> ModelGraph        tracing
    evaluate     + cluster, a config         -> Plan              tracing, estimate, plan
    parallelize  + cluster                   -> the best Plan     tracing, estimate, solve, plan
    replan       a Plan, a new cluster size  -> Plan              plan.rebuild, then the above
    save         a Plan, a directory         -> plan.json, train.py, launchers   plan, codegen
    export       a Plan, a framework         -> its config file   plan.rebuild, evaluate, codegen
    plot         a Plan, a kind, a path      -> PNG               plan.plots

docs/architecture.md draws the phases and what flows between them. Helpers live with their
phase; this file only sequences them.
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from torch import nn

from autopar.codegen import program_text
from autopar.codegen.export import TARGETS, Exported, Priced, export_plan, model_shape
from autopar.codegen.launchers import LAUNCHERS
from autopar.config import ParallelConfig
from autopar.config.precision import base_precision, canonical
from autopar.errors import ConfigError
from autopar.estimate import CostOptions, Estimate, Estimator, StageMesh, build_tables
from autopar.estimate.module_regions import model_regions, module_sets
from autopar.estimate.options import stack_problems
from autopar.estimate.stacks import load_stack, stack_options
from autopar.hardware import Cluster, Reliability
from autopar.plan import Plan
from autopar.plan.build import (
    ModelFactory,
    plan_from_estimate,
    with_goodput,
    with_solution,
    with_sources,
)
from autopar.plan.files import directory_lock, ensure_directory, write_atomic
from autopar.plan.rebuild import rebuild_model, replanned_note, resized_cluster, sample_inputs
from autopar.plan.training import with_training
from autopar.runtime.capability import (
    attention_refusal,
    mxfp8_tp_width,
    own_runtime,
    precision_candidates,
    runtime_limits,
    runtime_problems,
    token_multiple,
    traced_roles,
)
from autopar.solve import PlanOptions, solve
from autopar.solve.limits import default_batch_for, space_limits
from autopar.solve.refine import RecordingEstimator
from autopar.solve.space import shape_problems
from autopar.tracing import ModelGraph, trace
from autopar.tracing.inputs import infer_example_inputs

__all__ = ["PlanOptions", "evaluate", "parallelize", "plot", "replan", "save", "trace"]


def parallelize(
    model: nn.Module,
    cluster: Cluster,
    example_inputs: Any = None,
    *,
    global_batch_size: int | None = None,
    precision: str = "bf16",
    optimizer: str = "adamw",
    options: PlanOptions | None = None,
    graph: ModelGraph | None = None,
    model_factory: ModelFactory = None,
    stack: str | None = None,
    loss_fn: str | None = None,
) -> Plan:
    """Find the fastest parallel configuration of ``model`` on ``cluster`` that fits in memory.

    Args:
        model: the model (parameters may be on the meta device).
        cluster: from `Cluster.from_profile`.
        example_inputs: one sample's inputs; inferred (token ids of the model's context length)
            for Hugging Face causal LMs and the zoo's language models when omitted.
        global_batch_size: sequences per step; default about 4M tokens (stated in the plan).
        precision, optimizer: as for `evaluate`; precision "auto" plans BF16 and every
            recipe the device (and the stack's runtime) runs, returns the fastest and notes
            what it bought, or why BF16 is the only choice (and which recipe it could not plan
            for this model, and why). For autopar's own runtime an MXFP8 plan has tp (and etp)
            only where each shard of its linears (each expert's slice) is a multiple of 32
            wide, and each rank's share of a sequence a multiple of 32 tokens
            (`autopar.runtime.capability`).
        options: PlanOptions (cost-model options, micro-batch sizes, progress callback).
        graph: a ModelGraph already traced from this model and inputs.
        model_factory: how the generated program builds the model: "module:function", or
            ("module:function", {kwargs}); default: the factory the zoo and Hugging Face
            builders record on the model (`model.autopar_factory`), else none (`plan.save`
            then writes plan.json only).
        stack: the software stack that will run the plan (`autopar.estimate.stacks`; a name
            or a .toml path): its kernels, memory and overlaps replace those of
            ``options.cost`` (its stage balancing is kept). Default: ``options.cost``'s, which
            is autopar's own runtime unless set.
        loss_fn: the loss the generated program trains with, "module:function" called as
            ``loss(outputs, targets)`` -> scalar (recorded with the factory); default: the
            factory's (next-token cross-entropy for causal language models).

    Returns:
        The best Plan, with `alternatives` (why each lost) and `report` (the search's figures).

    Raises:
        InfeasibleError: nothing fits; says how much memory the most frugal config needs and the
            smallest number of nodes that would hold it.
        ConfigError: autopar's runtime trains no config of this model in ``precision`` (MXFP8
            with a sequence that is no multiple of 32 tokens).
    """
    options = options or PlanOptions()
    if stack is not None:
        stacked = replace(load_stack(stack).options, balance_stages=options.cost.balance_stages)
        options = replace(options, cost=stacked)
    notes: list[str] = []
    start = time.perf_counter()
    if graph is None:
        if example_inputs is None:
            example_inputs = infer_example_inputs(model)
            notes.append(f"inputs inferred: token ids of shape {tuple(example_inputs[0].shape)}")
        graph = trace(model, example_inputs)
    trace_s = time.perf_counter() - start
    if global_batch_size is None:
        base = "bf16" if precision == "auto" else base_precision(precision)
        global_batch_size, note = default_batch_for(graph, cluster, base)
        notes.append(note)
    if precision == "auto":
        source = (model_factory, loss_fn)
        return _parallelize_auto(
            model, cluster, graph, global_batch_size, optimizer, options, source, notes
        )
    precision = canonical(precision)
    estimator = RecordingEstimator(
        build_tables(graph), cluster, precision=precision, optimizer=optimizer, options=options.cost
    )
    limits = space_limits(model, graph, cluster, global_batch_size, options.micro_batch_sizes)
    # async TP where the stack runs it and it hides more than the stack's own TP overlap
    limits = replace(
        limits,
        async_tp=options.cost.async_tp_overlap > options.cost.tp_comm_overlap,
        ep_over_tp=options.cost.stack in EP_FOLDING_STACKS,
        zero_over_cp=options.cost.fsdp_over_cp,
        recompute_modules=(
            module_sets(model_regions(graph))
            if options.cost.stack in MODULE_RECOMPUTE_STACKS
            else ()
        ),
    )
    bounded: list[str] = []
    roles: tuple[dict[str, str], str] = ({}, "")
    if own_runtime(options.cost.stack):  # only what autopar's runtime can run
        roles = traced_roles(model, graph)
        attention = attention_refusal(model, graph) if limits.max_cp > 1 else ""
        limits, bounded = runtime_limits(
            model, limits, options.cost.stack, roles, precision, attention, graph.meta_constants
        )
    notes += bounded
    solution = solve(estimator, graph, cluster, limits, options)
    plan = plan_from_estimate(solution.best, graph, cluster, precision, optimizer, estimator)
    plan = replace(plan, tensor_parallel_roles=roles[0])
    plan = with_sources(plan, model, model_factory, cluster, loss_fn)
    plan = with_goodput(plan, cluster, options.reliability)
    timings = {"trace": trace_s, **solution.timings, "total": time.perf_counter() - start}
    plan = with_solution(plan, solution, limits, notes, timings)
    site_plan = None
    if _prices_diloco(cluster, options, global_batch_size):  # one replica group per site
        site_plan = parallelize(
            model, cluster.one_site(), graph=graph, precision=precision, optimizer=optimizer,
            global_batch_size=global_batch_size // cluster.sites, model_factory=model_factory,
            loss_fn=loss_fn, options=replace(
                options, algorithms=replace(options.algorithms, choose="sync"), sensitivity=False
            ),
        )  # fmt: skip
    plan = with_training(plan, site_plan, cluster, options.algorithms, options.reliability)
    if site_plan is None:
        return plan
    # the site's search ran inside this one: the total is both
    return replace(plan, timings={**plan.timings, "total": time.perf_counter() - start})


# the stacks that recompute named parts of a block (Megatron-Core's --recompute-modules)
MODULE_RECOMPUTE_STACKS = ("megatron-core", "megatron-bridge")
# the stacks whose runtimes fold expert parallelism over the tp ranks too (Megatron-Core's
# MoE parallel folding; torchtitan's ep over dp_shard x cp x tp with etp = 1)
EP_FOLDING_STACKS = ("megatron-core", "megatron-bridge", "megatron-lm", "torchtitan",
                     "torchtitan-compile")  # fmt: skip


def _prices_diloco(cluster: Cluster, options: PlanOptions, global_batch_size: int) -> bool:
    """Whether `parallelize` plans one site for DiLoCo: several sites, DiLoCo not ruled out,
    and a global batch the sites divide."""
    return (
        cluster.sites > 1
        and options.algorithms.choose in ("auto", "diloco")
        and global_batch_size % cluster.sites == 0
    )


def _parallelize_auto(
    model: nn.Module,
    cluster: Cluster,
    graph: ModelGraph,
    global_batch_size: int,
    optimizer: str,
    options: PlanOptions,
    source: tuple[ModelFactory, str | None],
    notes: list[str],
) -> Plan:
    """``precision="auto"``: the fastest plan over BF16 and the recipes the device and the
    stack run (`runtime.capability.precision_candidates`), with a note of what it bought."""
    names, why_not = precision_candidates(cluster.profile, options.cost.stack)
    plans, refused = {}, []
    for name in names:
        try:
            plans[name] = parallelize(
                model, cluster, global_batch_size=global_batch_size, precision=name,
                optimizer=optimizer, options=options, graph=graph, model_factory=source[0],
                loss_fn=source[1],
            )  # fmt: skip
        except ConfigError as error:  # a recipe the runtime cannot train this model in
            if name == "bf16":
                raise
            refused.append(f"{name} not planned: {error}")
    best = min(plans.values(), key=_to_budget)
    bf16 = plans["bf16"].step_time_s
    if why_not or len(plans) == 1:
        said = f"precision auto: bf16, {why_not or 'no recipe could be planned'}"
    else:
        others = ", ".join(
            f"{name} {bf16 / p.step_time_s:.2f}x" for name, p in plans.items() if name != "bf16"
        )
        said = (
            f"precision auto: {best.precision}, {bf16 / best.step_time_s:.2f}x the speed of bf16 "
            f"({best.step_time_s:.3f} s against {bf16:.3f} s a step; {others})"
        )
    return replace(best, notes=(*notes, said, *refused, *best.notes))


def _to_budget(plan: Plan) -> float:
    """What `precision="auto"` compares: the time to the token budget under the plan's chosen
    training algorithm (a DiLoCo plan's step is one site's, on its share of the batch), else
    the step time."""
    chosen = (plan.training or {}).get("chosen")
    return chosen["time_to_budget_s"] if chosen else plan.step_time_s


def evaluate(
    model: nn.Module,
    cluster: Cluster,
    config: ParallelConfig,
    example_inputs: Any = None,
    *,
    global_batch_size: int,
    precision: str = "bf16",
    optimizer: str = "adamw",
    options: CostOptions | None = None,
    graph: ModelGraph | None = None,
    model_factory: ModelFactory = None,
    stack: str | None = None,
    reliability: Reliability | None = None,
    loss_fn: str | None = None,
) -> Plan:
    """Price one parallel configuration of ``model`` on ``cluster`` with autopar's cost model.

    Args:
        model: the model (parameters may be on the meta device).
        cluster: from `Cluster.from_profile`.
        config: the degrees, schedule, recompute policy, micro-batch size to price.
        example_inputs: one sample's inputs (batch 1); not needed when ``graph`` is given.
        global_batch_size: sequences per optimizer step.
        precision: "bf16", "fp16" or "fp32" (training dtype; fp32 master weights otherwise), or
            a low-precision recipe for the blocks' linears on BF16 (`autopar.config.precision`:
            "fp8" = "fp8-tensorwise", "fp8-rowwise", "mxfp8", "nvfp4"); a device without its
            tensor cores is refused naming both.
        optimizer: "adamw", "adam", "sgd", "sgd_momentum".
        options: framework behaviour (overlaps, buffer sizes, kernels); default: the stack
            autopar's own runtime.
        stack: price the run on this software stack instead (`autopar.estimate.stacks`: a name
            such as "torchtitan" or "megatron-core", or a .toml path); not with ``options``.
        reliability: failure rate, restart and checkpoint bandwidth for the plan's goodput
            (`autopar.hardware.Reliability`); default: the profile's [reliability] table.
        graph: a ModelGraph already traced from this model and inputs (skips tracing).
        model_factory: as for `parallelize`: what the saved program calls to build the model.
        loss_fn: as for `parallelize`: the loss the saved program trains with.

    Returns:
        A Plan with the predicted step time, its breakdown, memory per stage and MFU.

    Raises:
        ConfigError: the config does not fit the cluster or the batch, or, priced for autopar's
            own stack, its runtime cannot run it for this model
            (`autopar.runtime.capability.runtime_problems`).
        TraceError: the model cannot be traced.
    """
    if graph is None:
        if example_inputs is None:
            raise ValueError("evaluate needs example_inputs (one sample) or a traced graph")
        graph = trace(model, example_inputs)
    limits = space_limits(model, graph, cluster, global_batch_size)
    options = stack_options(stack, options)
    own = own_runtime(options.stack)  # another stack's program is that framework's to run
    roles: tuple[dict[str, str], str] = traced_roles(model, graph) if own else ({}, "")
    if own and (multiple := token_multiple(precision)) > 1:
        # MXFP8's blocks split the sequence and the tp shards' widths (runtime.capability)
        width, _ = mxfp8_tp_width(model, roles[0])
        limits = replace(limits, token_multiple=multiple, tp_width=width)
    problems = config.problems(cluster) + shape_problems(config, limits)
    problems += stack_problems(config, options)
    if own:
        attention = attention_refusal(model, graph) if config.cp > 1 else ""
        problems += runtime_problems(
            model, config, limits.num_blocks, options.stack, roles, limits.seq_len, precision,
            attention, graph.meta_constants,
        )  # fmt: skip
    if problems:
        raise ConfigError(
            f"config {config.as_text()} cannot run {graph.model_type} on "
            f"{cluster.profile.name} x {cluster.num_nodes} ({cluster.world_size} devices): "
            + "; ".join(problems)
        )
    precision = canonical(precision)
    estimator = Estimator(
        build_tables(graph), cluster, precision=precision, optimizer=optimizer, options=options
    )
    estimate = estimator.evaluate(config, global_batch_size)
    plan = plan_from_estimate(estimate, graph, cluster, precision, optimizer, estimator)
    plan = replace(plan, tensor_parallel_roles=roles[0])
    plan = with_sources(plan, model, model_factory, cluster, loss_fn)
    return with_goodput(plan, cluster, reliability)


def evaluate_stages(
    model: nn.Module,
    cluster: Cluster,
    stages: list[StageMesh],
    example_inputs: Any = None,
    *,
    global_batch_size: int,
    micro_batch_size: int,
    precision: str = "bf16",
    optimizer: str = "adamw",
    stack: str | None = None,
    options: CostOptions | None = None,
    graph: ModelGraph | None = None,
) -> Estimate:
    """Price a pipeline whose stages each have their own tp and dp and may cut inside layers
    (the plans operator-level planners such as Aceso search), one `StageMesh` per stage over
    the model's layer names (`autopar.estimate.staged`). The stages' meshes are priced, not
    run: `ParallelConfig` and the generated program hold one mesh for every stage.

    Args:
        stages: per pipeline stage its tp, dp and `StagePart`s (layer, share of the layer,
            share of its forward recomputed, activations kept), every layer held once in all.
        micro_batch_size: sequences per micro-batch; a stage's dp ranks split each one.
        Others: as for `evaluate` (``stack`` is the software stack to price for).

    Returns:
        An `Estimate`: the step time and its breakdown, and per stage its times and memory.

    Raises:
        ConfigError: the stages do not use the cluster's devices, hold a layer other than
            once, or do not divide the batch.
    """
    if graph is None:
        if example_inputs is None:
            raise ValueError("evaluate_stages needs example_inputs (one sample) or a graph")
        graph = trace(model, example_inputs)
    estimator = Estimator(
        build_tables(graph),
        cluster,
        precision=canonical(precision),
        optimizer=optimizer,
        options=stack_options(stack, options),
    )
    return estimator.evaluate_stages(stages, global_batch_size, micro_batch_size)


def replan(
    plan: Plan,
    *,
    num_nodes: int | None = None,
    num_devices: int | None = None,
    config: ParallelConfig | None = None,
    options: PlanOptions | CostOptions | None = None,
    example_inputs: Any = None,
    profile: str | None = None,
    trust_factory: bool = False,
) -> Plan:
    """Plan ``plan``'s model again for a smaller or larger cluster of the same profile (and,
    for a plan priced over several sites, the same sites, link and latency: the size given is
    the whole cluster's, a DiLoCo plan's too).

    The model is rebuilt on the meta device from the plan's factory and checked against its
    fingerprint; the global batch, precision and optimizer are the plan's. A run resumes under
    the new plan from a checkpoint saved under the old one (checkpoints hold the state by full
    parameter name and torch.distributed.checkpoint reshards it on load; the step is kept,
    because the global batch is).

    Args:
        plan: a Plan with a model factory (`plan.model_source`).
        num_nodes: nodes of the plan's profile (devices per node as in the plan).
        num_devices: total devices (with ``num_nodes``: devices per node = the quotient).
        config: price this config (`evaluate`) instead of searching.
        options: `PlanOptions` for the search (or `CostOptions` with ``config``).
        example_inputs: one sample's inputs, for a factory that is neither zoo nor a
            language model with `config.vocab_size`.
        profile: a profile .toml path when the plan's profile is not a shipped name.
        trust_factory: consent to import and call the factory a plan read from a file names,
            when it is not one of autopar's own (`autopar.models.source.refuse_untrusted`).

    Returns:
        The new Plan, its notes naming the plan it replaces.

    Raises:
        ReplanError: no factory, a changed model, no size given.
        UntrustedFactoryError: the plan's own factory, without ``trust_factory``.
        ConfigError / InfeasibleError: ``config`` does not fit, or nothing fits.

    Example:
        >>> small = replan(plan, num_devices=2)     # doctest: +SKIP
        >>> small.save("out-2/")                    # resume with --checkpoint-dir as before
    """
    cluster = resized_cluster(plan, num_nodes, num_devices, profile)
    model = rebuild_model(plan, trust_factory=trust_factory)
    inputs = example_inputs if example_inputs is not None else sample_inputs(plan, model)
    source = plan.model_source
    common: dict[str, Any] = dict(
        global_batch_size=plan.global_batch_size,
        precision=plan.precision,
        optimizer=plan.optimizer,
        options=options,
        model_factory=(source.factory, source.kwargs),
        loss_fn=source.loss,
    )
    if config is not None:
        new = evaluate(model, cluster, config, inputs, **common)
    else:
        new = parallelize(model, cluster, inputs, **common)
    return replace(new, notes=(*new.notes, replanned_note(plan)))


def save(
    plan: Plan, directory: str | Path, *, program: bool = True, trust_factory: bool = False
) -> Path:
    """Write ``plan.json`` into ``directory`` (created if needed) and, when the plan knows its
    model factory and ``program`` is true, the generated ``train.py`` beside it
    (`autopar.codegen.program_text`); returns the plan's path. `Plan.save` calls this.

    The two are written as a pair: each atomically, under a lock on the directory, so two
    processes saving into one directory leave one plan's pair. A plan read from a file whose
    factory is not autopar's own needs ``trust_factory=True`` to write its program.

    Run the program with ``torchrun --nproc-per-node=N directory/train.py``.
    """
    files = {}  # the program first: if its model does not build, nothing is written
    if program and plan.model_source is not None:
        files["train.py"] = program_text(plan, trust_factory=trust_factory)
        files.update({name: render(plan) for name, render in LAUNCHERS.items()})
    with directory_lock(directory):  # another process saving here waits: one plan's files
        path = plan.write_json(directory)
        for name, text in files.items():
            write_atomic(path.parent / name, text)
    return path


def export(
    plan: Plan,
    target: str,
    directory: str | Path | None = None,
    *,
    price: bool = True,
    trust_factory: bool = False,
) -> Exported:
    """``plan`` as the configuration of another framework: torchtitan's job TOML, Megatron-LM
    arguments, a DeepSpeed JSON or an Accelerate config (`autopar.codegen.export`).

    With the plan's model factory, the model is rebuilt on the meta device: its shape fills
    the arguments of frameworks that build their own model (Megatron), and with ``price`` the
    plan's config is priced again on the target's software stack (`autopar.estimate.stacks`),
    both figures in the file's header. What the target cannot express is named there too.

    Args:
        plan: a Plan (`parallelize`, `evaluate`, or `Plan.load`).
        target: "torchtitan", "megatron", "deepspeed" or "accelerate".
        directory: write the file here (`Exported.filename`); None: only return it.
        price: re-price on the target's stack (a trace of the model: seconds for 8B).
        trust_factory: as for `save`, for a plan file naming a factory of its own.

    Raises:
        ValueError: an unknown target.
        UntrustedFactoryError: the plan file's own factory, without ``trust_factory``.
    """
    if target not in TARGETS:
        raise ValueError(f"no exporter for {target!r}: choose one of {', '.join(TARGETS)}")
    shape = priced = None
    if plan.model_source is not None:
        model = rebuild_model(plan, trust_factory=trust_factory)
        shape = model_shape(getattr(model, "config", None))
        stack = TARGETS[target][1]
        if price and stack != plan.stack:  # the model built above, priced on the stack
            again = evaluate(
                model,
                resized_cluster(plan, plan.num_nodes, plan.world_size, None),
                plan.config,
                sample_inputs(plan, model),
                global_batch_size=plan.global_batch_size,
                precision=plan.precision,
                optimizer=plan.optimizer,
                stack=stack,
            )
            priced = Priced(stack, again.step_time_s, again.peak_memory_bytes)
    exported = export_plan(plan, target, shape, priced)
    if directory is not None:
        write_atomic(ensure_directory(directory) / exported.filename, exported.text)
    return exported


def plot(plan: Plan, kind: str, path: str | Path) -> Path:
    """Save a PNG of ``plan``: ``kind`` is "pipeline" (Gantt per stage), "memory" (per stage)
    or "breakdown" (step time by term). Needs matplotlib. `Plan.plot` calls this."""
    from autopar.plan.plots import plot_plan  # matplotlib loads only when a plot is asked for

    return plot_plan(plan, kind, path)


# Helpers autopar 0.1 kept here, now with their phase: still importable from autopar.api, with
# a DeprecationWarning naming where they live.
_MOVED = {
    "attention_heads": "autopar.solve.limits",
    "DEFAULT_BATCH_TOKENS": "autopar.solve.limits",
    "plan_from_estimate": "autopar.plan.build",
}


def __getattr__(name: str) -> object:
    if name not in _MOVED:
        raise AttributeError(f"module 'autopar.api' has no attribute {name!r}")
    import importlib
    import warnings

    warnings.warn(
        f"autopar.api.{name} moved to {_MOVED[name]}.{name}", DeprecationWarning, stacklevel=2
    )
    return getattr(importlib.import_module(_MOVED[name]), name)
