"""The text of `Plan.summary()` and `Plan.explain()`, from the plan's data alone.

In: a `Plan` (plain data: no cluster, no model). Out: deterministic text; the only wall-clock
figures are the plan's `timings`, printed last and only when present (a loaded plan has none).
`summary_text` fits one screen: what was planned, where each mesh axis runs, the step-time
breakdown, the stages, the nearest alternatives. `explain_text` says why: the bottleneck term,
the binding constraint, what each runner-up loses and the what-if re-plans.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from autopar.config.precision import recipe_of
from autopar.plan.training_text import training_explanation, training_lines

if TYPE_CHECKING:
    from autopar.plan.types import Plan

GiB = 2**30
# the breakdown's documented order (README); a loaded plan's dict comes back sorted by name
TERM_ORDER = (
    *("compute_forward", "compute_backward", "recompute", "tp_comm", "cp_comm", "ep_comm"),
    *("fsdp_comm", "pipeline_bubble", "dp_comm", "optimizer", "grad_clip", "stragglers"),
)
COMPUTE_TERMS = (
    *("compute_forward", "compute_backward", "recompute", "optimizer", "grad_clip"),
    "stragglers",  # the step's work at its slowest device's pace
)


def summary_text(plan: Plan) -> str:
    cfg = plan.config
    lines = [
        f"Plan for {plan.model} ({plan.num_params / 1e9:.2f} B params, seq {plan.seq_len}) on "
        f"{plan.cluster} x {plan.num_nodes} = {plan.world_size} devices",
        f"  config      {cfg.as_text()}",
        *_mesh_lines(plan),
        f"  batch       {plan.global_batch_size} sequences = {plan.num_microbatches} "
        f"micro-batches of {cfg.micro_batch_size} x {cfg.data_parallel_size} data-parallel",
        f"  step time   {plan.step_time_s:.3f} s   MFU {plan.mfu:.1%}{_mfu_peak(plan)}   "
        f"{plan.tokens_per_s:,.0f} tokens/s   ({plan.precision}, {plan.optimizer}, priced for "
        f"the {plan.stack} stack)",
        f"  memory      peak {plan.peak_memory_bytes / GiB:.1f} GiB of "
        f"{plan.memory_capacity_bytes / GiB:.1f} GiB per device"
        + ("" if plan.fits else "   DOES NOT FIT"),
        *_goodput_line(plan),
        *training_lines(plan.training),
        *_experts_line(plan),
        "",
        "  step-time breakdown:",
    ]
    for name, seconds in ordered_terms(plan.breakdown):
        if seconds > 0:
            share = seconds / plan.step_time_s
            lines.append(f"    {name:<18} {seconds:9.4f} s  {share:6.1%}")
    lines += ["", *_stage_table(plan)]
    if plan.alternatives:
        lines += ["", "  nearest alternatives (step time, change, peak memory):"]
        for alt in plan.alternatives:
            delta = alt["step_time_s"] / plan.step_time_s - 1
            over = alt["peak_memory_bytes"] > plan.memory_capacity_bytes
            lines.append(
                f"    {alt['config']}  {alt['step_time_s']:.3f} s {delta:+.1%}  "
                f"{alt['peak_memory_bytes'] / GiB:.1f} GiB" + ("  DOES NOT FIT" if over else "")
            )
    if plan.model_source is not None:
        lines.append(f"  model from  {plan.model_source.as_text()}")
    lines += [f"  note: {n}" for n in plan.notes]
    if plan.timings:
        lines.append("  planned in " + ", ".join(f"{k} {v:.2f} s" for k, v in plan.timings.items()))
    return "\n".join(lines)


def _mesh_lines(plan: Plan) -> list[str]:
    if not plan.mesh:
        return ["  mesh        one device group: no parallel axis"]
    per_node = plan.world_size // max(plan.num_nodes, 1)
    texts = [axis_text(entry, per_node) for entry in plan.mesh]
    return [f"  {'mesh' if i == 0 else '':<11} {t}" for i, t in enumerate(texts)]


def _stage_table(plan: Plan) -> list[str]:
    lines = [
        f"  {'stage':<5} {'layers':<34} {'fwd/mb s':>9} {'bwd/mb s':>9} {'GiB':>6}"
        "  (params/grads/optim/activations)"
    ]
    for st in plan.stages:
        mem = st.memory_bytes
        parts = "/".join(
            f"{mem.get(k, 0.0) / GiB:.1f}"
            for k in ("parameters", "gradients", "optimizer", "activations")
        )
        lines.append(
            f"  {st.index:<5} {_layer_span(st.layers):<34} {st.forward_s:9.4f} "
            f"{st.backward_s:9.4f} {st.peak_memory_bytes / GiB:6.1f}  ({parts})"
        )
    return lines


def _layer_span(layers: tuple[str, ...]) -> str:
    if not layers:
        return "-"
    first, last = (_short(layers[0]), _short(layers[-1]))
    text = f"{len(layers)}: {first}" + (f" .. {last}" if len(layers) > 1 else "")
    return text if len(text) <= 34 else text[:31] + "..."


def _short(name: str) -> str:
    return name.removeprefix("model.")


# ---------------------------------------------------------------------------------- explain


def explain_text(plan: Plan) -> str:
    lines = [
        f"Why this plan: {plan.config.as_text()} "
        f"({plan.model} on {plan.cluster} x {plan.num_nodes}, step {plan.step_time_s:.3f} s)",
        _bottleneck(plan),
        _binding(plan),
        _memory(plan),
        _failures(plan),
        training_explanation(plan.training),
    ]
    limits = plan.report.get("limits") if plan.report else None
    if plan.config.recompute_layers is not None:
        lines.append(_recompute_layers(plan, limits))
    if limits:
        lines.append(_divisibility(limits))
    if plan.alternatives:
        lines.append("Runners-up:")
        lines += [f"  {_loses(plan, alt)}" for alt in plan.alternatives]
    if plan.sensitivity:
        lines.append("Sensitivity (re-planned on a changed cluster):")
        lines += sensitivity_lines(plan.sensitivity, plan.config.as_text())
    else:
        lines.append(
            "Sensitivity: not computed for this plan (parallelize computes it; evaluate does not)"
        )
    if plan.report.get("refine"):
        lines += refine_lines(plan.report["refine"])
    if plan.report.get("text"):
        lines.append(f"Search: {plan.report['text']}")
    if plan.timings:
        lines.append("Timings: " + ", ".join(f"{k} {v:.2f} s" for k, v in plan.timings.items()))
    return "\n".join(lines)


def duration(seconds: float) -> str:
    """Seconds as a person reads them: s, min, h or days."""
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    if seconds < 2 * 86400:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} days"


def _experts_line(plan: Plan) -> list[str]:
    """A mixture-of-experts model's routing as priced (`Plan.experts`); none when dense."""
    e = plan.experts
    if not e:
        return []
    from autopar.estimate.memory import expert_shard_ways  # here: `import autopar` stays torch-free

    ep, ways = plan.config.ep, expert_shard_ways(plan.config)
    where = f"{int(e['num_experts']) // ep} per rank over ep={ep}" if ep > 1 else "no ep"
    if ep > 1 and ways > 1:  # each layer's experts an FSDP unit
        where += f", their state sharded over the {ways} ranks holding them"
    if plan.config.etp > 1:
        where += f", each split over tp={plan.config.etp}"
    elif plan.config.tp > 1:
        where += f", each whole on the {plan.config.tp} tp ranks"
    even = (
        "tokens spread evenly; a learned router's skew is higher: the program prints the "
        "busiest rank's measured load, which --moe-imbalance / CostOptions.moe_imbalance takes"
        if e["imbalance"] == 1.0
        else "the busiest ep rank's routed rows over the mean"
    )
    return [
        f"  experts     {int(e['moe_layers'])} MoE layers of {int(e['num_experts'])} experts "
        f"({where}), top {int(e['top_k'])}: {e['active_params'] / 1e9:.1f} B of "
        f"{plan.num_params / 1e9:.1f} B parameters active per token (routed FLOPs priced); "
        f"load imbalance {e['imbalance']:.2f} priced ({even})"
    ]


def _goodput_line(plan: Plan) -> list[str]:
    g = plan.goodput
    if not g:
        return []
    steps = int(g["async_interval_steps"])
    return [
        f"  goodput     {g['async_goodput']:.1%} checkpointing in the background every {steps} "
        f"steps ({duration(steps * plan.step_time_s)}); {g['sync_goodput']:.1%} blocking every "
        f"{int(g['sync_interval_steps'])}; MTBF {duration(g['mtbf_s'])}"
    ]


def _failures(plan: Plan) -> str:
    g = plan.goodput
    if not g:
        return "Failures: not priced (the profile has no [reliability] table; pass reliability=)"
    return (
        f"Failures: MTBF {duration(g['mtbf_s'])} on {plan.world_size} devices "
        f"({g['failure_rate_per_device_hour']:.3g} per device-hour); a checkpoint holds "
        f"{g['checkpoint_bytes'] / 1e9:,.1f} GB: in the background it stalls training "
        f"{duration(g['async_checkpoint_s'])} and is on disk {duration(g['commit_lag_s'])} "
        f"later, blocking it stops training {duration(g['sync_checkpoint_s'])}; a restart costs "
        f"{duration(g['restart_s'])}. Young/Daly intervals: every "
        f"{int(g['async_interval_steps'])} steps in the background (goodput "
        f"{g['async_goodput']:.2%}), every {int(g['sync_interval_steps'])} blocking "
        f"({g['sync_goodput']:.2%}); train.py --checkpoint-every auto takes them."
    )


def _bottleneck(plan: Plan) -> str:
    terms = {k: v for k, v in plan.breakdown.items() if v > 0}
    if not terms:
        return "Bottleneck: none (the step has no cost terms)"
    top = max(terms, key=terms.__getitem__)
    compute = sum(v for k, v in terms.items() if k in COMPUTE_TERMS)
    bubble = terms.get("pipeline_bubble", 0.0)
    comm = sum(v for k, v in terms.items() if k.endswith("_comm"))
    step = plan.step_time_s
    return (
        f"Bottleneck: {top} takes {terms[top] / step:.0%} of the step; compute "
        f"{compute / step:.0%}, exposed communication {comm / step:.0%}, "
        f"pipeline bubble {bubble / step:.0%}."
    )


def _binding(plan: Plan) -> str:
    over = [a for a in plan.alternatives if a["peak_memory_bytes"] > plan.memory_capacity_bytes]
    cap = plan.memory_capacity_bytes / GiB
    if over:
        fastest = min(over, key=lambda a: a["step_time_s"])
        gain = 1 - fastest["step_time_s"] / plan.step_time_s
        return (
            f"Binding constraint: memory. {fastest['config']} would be {gain:.1%} faster but "
            f"needs {fastest['peak_memory_bytes'] / GiB:.1f} GiB per device of {cap:.1f} GiB."
        )
    if not plan.fits:
        return f"Binding constraint: memory. This config does not fit ({cap:.1f} GiB per device)."
    if not plan.report:
        spare = (plan.memory_capacity_bytes - plan.peak_memory_bytes) / GiB
        return (
            f"Binding constraint: not searched (a config priced by evaluate); it fits with "
            f"{spare:.1f} GiB per device to spare."
        )
    return (
        "Binding constraint: none on memory: no faster config was found that does not fit; "
        "the degrees are bound by divisibility and the cluster's size."
    )


def _memory(plan: Plan) -> str:
    worst = max(plan.stages, key=lambda s: s.peak_memory_bytes)
    biggest = max(worst.memory_bytes, key=worst.memory_bytes.__getitem__)
    return (
        f"Memory: stage {worst.index} is the fullest at {worst.peak_memory_bytes / GiB:.1f} GiB "
        f"of {plan.memory_capacity_bytes / GiB:.1f} GiB; its largest part is {biggest} "
        f"({worst.memory_bytes[biggest] / GiB:.1f} GiB)."
    )


def _recompute_layers(plan: Plan, limits: dict[str, Any] | None) -> str:
    cfg = plan.config
    chunks = cfg.pp * cfg.virtual_stages
    of = f" of {-(-limits['num_blocks'] // chunks)}" if limits else ""
    where = "the model" if chunks == 1 else f"each of the {chunks} model chunks"
    return (
        f"Recompute: {cfg.recompute} on the first {cfg.recompute_layers}{of} repeated layers "
        f"of {where}; the others keep their activations"
        + (" (fewer did not fit in memory)." if limits else ".")
    )


def _divisibility(lim: dict[str, Any]) -> str:
    heads = f"{lim['num_heads']} heads" if lim.get("num_heads") else "the heads"
    if lim.get("num_kv_heads"):
        heads += f" and {lim['num_kv_heads']} key/value heads"
    text = (
        f"Divisibility: tp divides the {lim['devices_per_node']} devices of a node and {heads}; "
        f"pp x virtual stages <= {lim['num_blocks']} repeated layers; dp x fsdp x micro-batch "
        f"divides the batch of {lim['global_batch_size']}"
    )
    if lim.get("num_experts"):
        text += f"; ep divides {lim['num_experts']} experts"
    return text + "."


def _loses(plan: Plan, alt: dict[str, Any]) -> str:
    delta = alt["step_time_s"] / plan.step_time_s - 1
    head = f"{alt['config']}: {delta:+.1%}"
    if alt["peak_memory_bytes"] > plan.memory_capacity_bytes:
        excess = (alt["peak_memory_bytes"] - plan.memory_capacity_bytes) / GiB
        return f"{head}, but over memory by {excess:.1f} GiB: it does not fit"
    if abs(delta) < 1e-4:
        return f"{head}, ties this plan's step time (ranked after it by its config text)"
    terms = alt.get("breakdown")
    if not terms:
        return f"{head} ({alt.get('why', '')})"
    diffs = sorted(
        ((k, v - plan.breakdown.get(k, 0.0)) for k, v in terms.items()),
        key=lambda kv: (-kv[1], kv[0]),
    )
    # terms that differ by less than 0.1% of the step are noise, not a reason
    worse = [f"{k} {d:+.3f} s" for k, d in diffs[:2] if d > 1e-3 * plan.step_time_s]
    return f"{head}, loses on " + (", ".join(worse) if worse else "no single term")


def refine_lines(refine: dict[str, Any], limit: int = 6) -> list[str]:
    """Text for `Plan.explain()`: how the intra-layer ILP re-priced the search's best configs
    (`autopar.solve.refine`), per re-priced config its per-layer and step-time change."""
    head = (
        f"ILP re-pricing: {refine['num_candidates']} best configs, {refine['num_repriced']} "
        f"re-priced with tensor parallelism ({refine['ilp_solves']} ILP solves, "
        f"{refine['cache_hits']} cache hits); "
        + ("it CHANGED the winner" if refine["changed"] else "the winner stands")
    )
    lines = [head]
    shown = [c for c in refine["candidates"] if c["layers"]][:limit]
    for c in shown:
        analytic = sum(v["analytic_s"] for v in c["layers"].values())
        ilp = sum(v["ilp_s"] for v in c["layers"].values())
        step = c["step_time_s"] / c["analytic_step_time_s"] - 1
        tp = c["config"].split(" tp=")[1].split()[0]
        text = (
            f"  the ILP re-priced tp={tp} {ilp / analytic - 1:+.1%} per layer "
            f"({analytic * 1e3:.3f} -> {ilp * 1e3:.3f} ms fwd+bwd), step {step:+.1%}: "
            f"{c['config']}"
        )
        if c.get("replicated"):
            text += " (its ILP plan does not divide the layer: tp runs replicated)"
        lines.append(text)
    skipped = sorted({c["skipped"] for c in refine["candidates"] if c.get("skipped")})
    lines += [f"  analytic price kept where {why}" for why in skipped]
    return lines


def axis_text(entry: dict[str, Any], devices_per_node: int) -> str:
    """One line, e.g. ``tp=8   inside one nvlink domain (8 devices = one node), 450 GB/s``."""
    axis, size, level = entry["axis"], entry["size"], entry["level"]
    head = f"{axis}={size}"
    bandwidth = f"{entry['bandwidth_bytes_per_s'] / 1e9:,.0f} GB/s/dir per device"
    what = "neighbouring stages" if axis == "pp" else f"{size} ranks"
    if level == "ici":
        return f"{head:<8} {what} over the TPU ICI torus, {bandwidth} per link"
    if entry["num_nodes"] <= 1:
        domain = entry["domain_devices"]
        if domain == devices_per_node:
            where = f"one {level} domain (the node)"
        elif domain:
            where = f"one {level} domain of {domain} devices"
        else:
            where = f"one node over {level}"
        return f"{head:<8} {what} inside {where}, {bandwidth}"
    return f"{head:<8} {what} across {entry['num_nodes']} nodes over {level}, {bandwidth}"


def sensitivity_lines(entries: tuple[dict[str, Any], ...], config_text: str) -> list[str]:
    """Text for `Plan.explain()`: per scenario, the pick, its time and the change."""
    lines = []
    for e in entries:
        if e.get("skipped"):
            lines.append(f"  {e['what']}: n/a ({e['skipped']})")
            continue
        base = e["baseline_step_time_s"]
        same = e["same_config_step_time_s"] / base - 1
        new = e["step_time_s"] / base - 1
        if e["config"] == config_text:
            lines.append(f"  {e['what']}: same config, step {e['step_time_s']:.3f} s ({new:+.1%})")
        else:
            lines.append(
                f"  {e['what']}: re-plan picks {e['config']}, step {e['step_time_s']:.3f} s "
                f"({new:+.1%}; this plan's config alone {same:+.1%})"
            )
    return lines


def ordered_terms(breakdown: dict[str, float]) -> list[tuple[str, float]]:
    """The breakdown in `TERM_ORDER`, terms it does not know after them by name."""
    rank = {name: i for i, name in enumerate(TERM_ORDER)}
    return sorted(breakdown.items(), key=lambda kv: (rank.get(kv[0], len(rank)), kv[0]))


def _mfu_peak(plan: Plan) -> str:
    """Which peak a low-precision plan's MFU is of: the BF16 one (the model's FLOPs over the
    BF16 peak, as torchtitan and NeMo report it), which FP8 GEMMs can exceed."""
    return " of the bf16 peak" if recipe_of(plan.precision) is not None else ""
