"""Pictures of a plan and of the cost model's accuracy, as PNG files (matplotlib).

In: a `Plan` (plain data) or rows of predicted and measured step times. Out: a PNG written
with matplotlib's Agg canvas (`matplotlib.figure.Figure`, no pyplot: no global backend state,
works headless); each `figure_*` returns the Figure, each `plot_*` saves it and returns the path.

    plot_plan(plan, "pipeline", "out/pipeline.png")   # Gantt chart of the schedule per stage
    plot_plan(plan, "memory", "out/memory.png")       # peak memory per stage, by part
    plot_plan(plan, "breakdown", "out/breakdown.png") # step time by term
    plot_published_runs(rows, "out/published.png")   # predicted vs measured step time

The Gantt chart re-runs `cost_models.pipeline.simulate_pipeline` on the plan's schedule and
stage times (one micro-batch through each stage). A plan stores each stage's backward as one
number; schedules that split backward (zero_bubble, dualpipe_v) are drawn with it split evenly
into input- and weight-gradient parts, which the chart's title says.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cost_models.pipeline import simulate_pipeline

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from autopar.plan.types import Plan

GiB = 2**30
KINDS = ("pipeline", "memory", "breakdown")
_TASK_COLOURS = {"F": "#4c72b0", "B": "#dd8452", "W": "#55a868"}
_MEMORY_PARTS = ("parameters", "gradients", "optimizer", "activations", "buffers", "reserve")
_SPLIT_BACKWARD = ("zero_bubble", "dualpipe_v")


def _figure(width: float, height: float) -> Figure:
    try:
        from matplotlib.figure import Figure
    except ImportError as err:
        raise ImportError("autopar's plots need matplotlib: pip install matplotlib") from err
    return Figure(figsize=(width, height), dpi=110, layout="constrained")


def _save(fig: Figure, path: str | Path) -> Path:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png")
    return out


def plot_plan(plan: Plan, kind: str, path: str | Path) -> Path:
    """Save one of the plan's pictures (``kind`` in `KINDS`) as a PNG at ``path``."""
    makers = {
        "pipeline": figure_pipeline,
        "memory": figure_memory,
        "breakdown": figure_breakdown,
    }
    if kind not in makers:
        raise ValueError(f"unknown plot kind {kind!r}; kinds: {', '.join(KINDS)}")
    return _save(makers[kind](plan), path)


def plot_all(plan: Plan, directory: str | Path) -> list[Path]:
    """Every picture of the plan into ``directory``: pipeline.png, memory.png, breakdown.png."""
    return [plot_plan(plan, kind, Path(directory) / f"{kind}.png") for kind in KINDS]


def figure_pipeline(plan: Plan, max_microbatches: int = 24) -> Figure:
    """Gantt chart per pipeline stage: each forward (F), backward (B) and weight-gradient (W)
    task of one step, from `simulate_pipeline` on the plan's schedule and stage times.

    Beyond ``max_microbatches`` the chart would be a solid bar; it then simulates that many
    micro-batches and says so in the title (the step's shape is the same, only longer).
    """
    cfg = plan.config
    split = cfg.schedule in _SPLIT_BACKWARD
    m = plan.num_microbatches
    shown = _microbatches_to_show(cfg.schedule, cfg.pp, m, max_microbatches)
    result = simulate_pipeline(
        cfg.schedule if cfg.pp > 1 else "gpipe",  # one stage: every schedule is the same
        cfg.pp,
        shown,
        forward_s=[s.forward_s for s in plan.stages],
        backward_input_s=[s.backward_s / 2 if split else s.backward_s for s in plan.stages],
        backward_weight_s=[s.backward_s / 2 if split else 0.0 for s in plan.stages],
        virtual_stages=cfg.virtual_stages,
    )
    fig = _figure(11, 1.0 + 0.45 * cfg.pp)
    ax = fig.add_subplot()
    for task in result.tasks:
        ax.broken_barh(
            [(task.start_s, task.end_s - task.start_s)],
            (task.stage - 0.4, 0.8),
            facecolors=_TASK_COLOURS[task.kind],
            edgecolor="white",
            linewidth=0.3,
        )
        if shown <= 16 and cfg.pp <= 16:
            ax.text(
                (task.start_s + task.end_s) / 2,
                task.stage,
                str(task.microbatch),
                ha="center",
                va="center",
                fontsize=6,
                color="white",
            )
    ax.set_yticks(range(cfg.pp), [f"stage {s}" for s in range(cfg.pp)])
    ax.invert_yaxis()
    ax.set_xlabel("seconds into the step")
    title = (
        f"{cfg.schedule}"
        + (f" v={cfg.virtual_stages}" if cfg.virtual_stages > 1 else "")
        + f", pp={cfg.pp}, {shown} micro-batches"
        + (f" (of {m})" if shown < m else "")
        + f": bubble {result.bubble_fraction:.1%}"
        + ("; backward split evenly into B and W" if split else "")
    )
    ax.set_title(title, fontsize=10)
    kinds = ("F", "B", "W") if split else ("F", "B")
    names = {"F": "forward", "B": "backward" if not split else "input grad", "W": "weight grad"}
    from matplotlib.patches import Patch

    ax.legend(
        handles=[Patch(color=_TASK_COLOURS[k], label=names[k]) for k in kinds],
        loc="upper left",
        bbox_to_anchor=(1.0, 1.0),
        fontsize=8,
    )
    return fig


def _microbatches_to_show(schedule: str, pp: int, m: int, limit: int) -> int:
    if m <= limit:
        return m
    # keep what the schedules require: interleaved m % pp == 0, dualpipe_v m >= 2 pp
    step = pp if schedule == "interleaved_1f1b" else 1
    shown = max(limit // step * step, step)
    return max(shown, 2 * pp) if schedule == "dualpipe_v" else shown


def figure_memory(plan: Plan) -> Figure:
    """Stacked bars: each stage's peak memory by part, against the device's capacity."""
    fig = _figure(max(7.0, 2.5 + 0.5 * len(plan.stages)), 3.8)
    ax = fig.add_subplot()
    xs = [s.index for s in plan.stages]
    bottom = [0.0] * len(xs)
    for part in _MEMORY_PARTS:
        heights = [s.memory_bytes.get(part, 0.0) / GiB for s in plan.stages]
        if any(h > 0 for h in heights):
            ax.bar(xs, heights, bottom=bottom, label=part, width=0.7)
            bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    cap = plan.memory_capacity_bytes / GiB
    ax.axhline(cap, color="black", linestyle="--", linewidth=1)
    ax.text(xs[-1] + 0.4, cap, f" capacity {cap:.1f} GiB", va="bottom", ha="right", fontsize=8)
    ax.set_xticks(xs, [str(x) for x in xs])
    ax.set_xlabel("pipeline stage")
    ax.set_ylabel("GiB per device")
    ax.set_ylim(0, max(cap, max(bottom)) * 1.15)
    ax.set_title("peak memory per stage\n" + plan.config.as_text(), fontsize=8)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return fig


def figure_breakdown(plan: Plan) -> Figure:
    """Horizontal bars: the step time by breakdown term (terms that are zero left out)."""
    from autopar.plan.text import ordered_terms

    terms = [(k, v) for k, v in ordered_terms(plan.breakdown) if v > 0]
    fig = _figure(7, 1.0 + 0.35 * max(len(terms), 1))
    ax = fig.add_subplot()
    names = [k for k, _ in terms]
    values = [v for _, v in terms]
    ax.barh(names, values, color="#4c72b0")
    for i, v in enumerate(values):
        ax.text(v, i, f" {v:.3g} s ({v / plan.step_time_s:.1%})", va="center", fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, max(values, default=1.0) * 1.35)
    ax.set_xlabel("seconds per step")
    ax.set_title(
        f"step {plan.step_time_s:.3f} s, MFU {plan.mfu:.1%}\n{plan.config.as_text()}", fontsize=8
    )
    return fig


# ---------------------------------------------------------------------------- published runs


def figure_published_runs(rows: Iterable[Any]) -> Figure:
    """Predicted against measured step time, log-log, one point per run with both numbers.

    ``rows``: objects or mappings with ``id``, ``measured_step_s`` and ``predicted_step_s``
    (`benchmarks/published_runs.py`'s `Result`, or the rows of its ``--json`` output); the
    source is the id's prefix up to the first underscore (meg21, kor22, mcore24, ...).
    """
    points: dict[str, list[tuple[float, float]]] = {}
    for row in rows:
        get = row.get if isinstance(row, Mapping) else lambda k, r=row: getattr(r, k, None)
        measured, predicted = get("measured_step_s"), get("predicted_step_s")
        if measured and predicted:
            points.setdefault(str(get("id")).split("_")[0], []).append((measured, predicted))
    if not points:
        raise ValueError("no row has both a measured and a predicted step time")
    fig = _figure(6, 5.2)
    ax = fig.add_subplot()
    every = [v for pts in points.values() for p in pts for v in p]
    lo, hi = min(every) / 1.5, max(every) * 1.5
    ax.plot([lo, hi], [lo, hi], color="black", linewidth=1, label="predicted = measured")
    for band, style in ((0.10, ":"), (0.25, "--")):
        for sign in (1, -1):
            f = 1 + sign * band
            ax.plot([lo, hi], [lo * f, hi * f], color="grey", linestyle=style, linewidth=0.8)
    errors = []
    for source, pts in sorted(points.items()):
        ax.scatter([p[0] for p in pts], [p[1] for p in pts], label=source, s=22)
        errors += [abs(p[1] / p[0] - 1) for p in pts]
    errors.sort()
    median = (
        errors[len(errors) // 2]
        if len(errors) % 2
        else sum(errors[len(errors) // 2 - 1 : len(errors) // 2 + 1]) / 2
    )
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(lo, hi)
    ax.set_ylim(lo, hi)
    ax.set_xlabel("measured step time (s)")
    ax.set_ylabel("predicted step time (s)")
    ax.set_title(
        f"{len(errors)} published runs: median |error| {median:.1%}, worst {errors[-1]:.1%}\n"
        "(dotted: +-10%, dashed: +-25%)",
        fontsize=9,
    )
    ax.legend(fontsize=8, loc="upper left")
    return fig


def plot_published_runs(rows: Iterable[Any], path: str | Path) -> Path:
    """Save `figure_published_runs` as a PNG at ``path``."""
    return _save(figure_published_runs(rows), path)
