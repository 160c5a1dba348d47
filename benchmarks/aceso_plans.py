"""Aceso's searched plans (data/aceso_stages.json) as autopar's per-stage meshes.

In: a plan of data/aceso_stages.json (per stage: how many of Aceso's GPT operators it runs,
its tp and dp, which operators it recomputes) and the layer names of the traced model, in
order. Out: one `StageMesh` per stage (`autopar.estimate.staged`).

Aceso cuts stages between operators: the embedding, 13 per transformer layer, the final
layernorm and the post-process (logits and loss). A stage's share of a layer is the share of
that layer's forward time in the operators it holds, and its recompute share that of the
operators it recomputes. An operator's time is its FLOPs at the device's peak plus its bytes
at its memory bandwidth: Aceso's Megatron runs attention step by step (score, softmax,
dropout, context), whose s x s x heads probabilities make the softmax and the dropout cost a
share of the layer that GEMM FLOPs alone would miss. What a part keeps of the layer's
activations is the share of the layer's saved bytes (Korthikanti et al. 2022's 34 s h + 5 a s^2
per layer, operator by operator) in the operators it holds and does not recompute, and in the
first operator of each run it recomputes (the run re-runs from that one's inputs). A run
starts afresh at each point of the residual stream -- a layer's input and the post-attention
sum, which the 2nd layernorm and the MLP's residual add both read (`RESIDUAL_OPS`) -- so a
recomputed stretch keeps the residual there, as Megatron's per-layer checkpoints keep each
layer's input (runs that crossed them priced the 164 measured stages' peaks a median 11.2% off,
worst -37.2%, the kept activations falling further short the more a stage recomputes: 0.91 of
the measured at under a fifth of its operators recomputed, 1.67 at over four fifths; with the
runs cut there, 8.8% and -21.3%, and 0.91-1.16 across those fifths:
`benchmarks/aceso_stages.py`). The embedding's operator takes the layers before the first
block, the post-process the layers after the last.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from pathlib import Path

from autopar import ParallelConfig
from autopar.estimate import Estimate, Estimator, StageMesh, StagePart, build_tables

PLANS = Path(__file__).resolve().parents[1] / "data" / "aceso_stages.json"
BLOCK_OPS = 13  # Aceso's operators per GPT layer (data/aceso_stages.json "operators")


@functools.cache  # read once: `price_plan` looks its plan up for every run it prices
def load_plans(path: Path = PLANS) -> dict[str, dict]:
    """The plans by the config path the csv's source names (shared: read, do not change)."""
    return json.loads(path.read_text())["plans"]


# What every tp rank saves whole (Megatron without sequence parallelism, as Aceso runs it:
# its model_ops_info.py op specs): the layernorms' inputs, the masks of the dropouts after
# attention and after the MLP, and the inputs of the qkv and MLP-up GEMMs (a column-parallel
# layer keeps its whole input); tp splits the rest
SAVED_WHOLE = (0, 1, 7, 8, 9, 12)
# The operators that read the residual stream (the 1st and 2nd layernorm): a run of recomputed
# operators starts at each, keeping the residual as its checkpoint (module docstring)
RESIDUAL_OPS = (0, 8)


def operator_seconds(
    hidden: int, seq: int, heads: int, peak_flops: float, bandwidth: float
) -> list[float]:
    """Per token, the forward seconds of each of a layer's 13 operators in order (2-byte
    activations; a 0.1 dropout keeps a 1-byte mask): a layer's shares, the same for a layer
    cut between stages of different tp, so that its parts add up to it."""
    h, s, a = hidden, seq, heads
    work = [
        (0, 4 * h),  # 1st layernorm: read and write h
        (6 * h * h, 2 * 4 * h),  # qkv GEMM
        (2 * s * h, 2 * (3 * h + s * a)),  # scores Q K^T: s probabilities per head
        (0, 4 * s * a),  # softmax over them
        (0, 5 * s * a),  # their dropout and its mask
        (2 * s * h, 2 * (s * a + 2 * h)),  # context: probabilities times V
        (2 * h * h, 4 * h),  # attention output GEMM
        (0, 5 * h),  # dropout after attention
        (0, 4 * h),  # 2nd layernorm
        (8 * h * h, 2 * 5 * h),  # MLP up GEMM
        (0, 16 * h),  # gelu on 4h
        (8 * h * h, 2 * 5 * h),  # MLP down GEMM
        (0, 5 * h),  # dropout after the MLP
    ]
    return [flops / peak_flops + nbytes / bandwidth for flops, nbytes in work]


def operator_saved_bytes(hidden: int, seq: int, heads: int, tp: int = 1) -> list[float]:
    """Per token, the bytes each of a layer's 13 operators saves for its backward without
    recompute on one of ``tp`` ranks (Korthikanti et al. 2022, sec. 4.1: 2-byte activations,
    1-byte dropout masks; of the 34 s h, the 10 s h in `SAVED_WHOLE` whole on every rank)."""
    h, sa = hidden, seq * heads
    attention = [2 * h, 2 * h, 4 * h, 2 * sa, sa, 2 * sa + 2 * h, 2 * h, h]
    saved = [*attention, 2 * h, 2 * h, 8 * h, 8 * h, h]
    return [b / (1 if k in SAVED_WHOLE else tp) for k, b in enumerate(saved)]


def stage_meshes(
    plan: dict,
    layer_names: list[str],
    block_names: list[str],
    weights: list[float],
    saved: Callable[[int], list[float]],
    layer_bytes: Callable[[int], float] | None = None,
) -> list[StageMesh]:
    """``plan``'s stages over the model's layers (``layer_names`` in order, of which
    ``block_names`` are the transformer layers), each layer operator weighted by ``weights``
    (`operator_seconds`) in time and ``saved(tp)`` (`operator_saved_bytes`) in memory at the
    stage's tp: a part keeps those bytes of what the whole layer saves, ``layer_bytes(tp)``
    per token as the estimator prices it (default: the operators' sum)."""
    if len(block_names) != plan["num_layers"]:
        raise ValueError(f"the plan has {plan['num_layers']} layers, the model {len(block_names)}")
    first = layer_names.index(block_names[0])
    last = layer_names.index(block_names[-1])
    out, op = [], 0
    for stage in plan["stages"]:
        nbytes = saved(stage["tp"])
        total = sum(weights)
        total_saved = layer_bytes(stage["tp"]) if layer_bytes else sum(nbytes)
        held: dict[str, list[float]] = {}  # layer -> [share, recompute, keeps]
        previous = "0"
        for flag in stage["recompute"]:
            if op == 0:
                names = layer_names[:first]
                part = (1.0, 0.0, 1.0)
            elif op > BLOCK_OPS * len(block_names):  # final layernorm, post-process
                names = layer_names[last + 1 :] if op == 2 + BLOCK_OPS * len(block_names) else []
                part = (1.0, 0.0, 1.0)
            else:
                block, k = divmod(op - 1, BLOCK_OPS)
                names = [block_names[block]]
                w, kept = weights[k] / total, nbytes[k] / total_saved
                # a run of recomputed operators re-runs from its first one's inputs, which
                # the forward keeps: the run's checkpoint; one at each residual point too
                checkpoint = kept if previous == "0" or k in RESIDUAL_OPS else 0.0
                part = (w, w, checkpoint) if flag == "1" else (w, 0.0, kept)
            previous = flag
            for name in names:
                got = held.setdefault(name, [0.0, 0.0, 0.0])
                for j in range(3):
                    got[j] += part[j]
            op += 1
        parts = tuple(
            StagePart(name, min(1.0, share), min(recompute, share), min(1.0, keeps))
            for name, (share, recompute, keeps) in held.items()
            if share > 0
        )
        out.append(StageMesh(parts, tp=stage["tp"], dp=stage["dp"]))
    return out


def price_plan(run, graph, cluster, options) -> tuple[Estimate, list[StageMesh]]:
    """The estimate of an Aceso row (`published_grids_mapping.GridRun` with a `stage_plan`)
    traced as ``graph``, on ``cluster`` under the stack ``options``, and its stages."""
    tables = build_tables(graph)
    estimator = Estimator(tables, cluster, precision=run.precision, options=options)
    plan = load_plans()[run.stage_plan]
    d, device = run.dims, cluster.profile.device
    peak, bandwidth = device.peak(run.precision), device.memory_bandwidth_bytes_per_s
    block = next(t for t in tables.layers if t.kind == "block")

    def layer_bytes(tp: int) -> float:  # per token, what the estimator's layer saves
        cfg = ParallelConfig(tp=tp, micro_batch_size=1)
        return estimator.memory.activation_bytes(cfg, block, "none") / d.seq_len

    stages = stage_meshes(
        plan,
        [t.name for t in tables.layers],
        [t.name for t in tables.layers if t.kind == "block"],
        operator_seconds(d.hidden, d.seq_len, d.num_heads, peak, bandwidth),
        lambda tp: operator_saved_bytes(d.hidden, d.seq_len, d.num_heads, tp),
        layer_bytes,
    )
    estimate = estimator.evaluate_stages(stages, run.global_batch, plan["micro_batch_size"])
    return estimate, stages
