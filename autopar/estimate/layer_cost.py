"""Time of one layer for one micro-batch under a config: compute and the per-layer collectives.

For a layer table T (per sample) and micro-batch size b, with t = tp, c = cp, e = ep:

    forward  = sum_matmul op_time(F_i b / d_i) + sum_attn op_time(F_a b / (t c))
               + sum_buckets op_time(memory-bound bytes b / m_k)                 (compute_forward)
    backward = the same with each op's backward FLOPs, memory-bound ops twice the bytes
    A stacked expert layer's matmul (`MatmulOp.groups`: transformers' grouped or batched
    experts) runs one GEMM per expert on the rank, E / e of them: each is priced at the matmul
    efficiency of its own size (the routed rows one expert receives), one launch in all.
    d_i = t c for tensor-parallel matmuls, c for replicated ones (the router) and for the
    experts: autopar's runtime splits them over ep only, each tp rank running its tokens'
    experts whole (its TP plan leaves them replicated), unless etp = tp, which splits each
    expert's width over the tp ranks (`autopar.runtime.expert_tensor_parallel`): t c;
    with sequence parallelism the router and experts run on the rank's sequence shard, t c;
    m_k = t c for sharded values, c for the experts' and replicated ones (t c with sequence
    parallelism) (`memory.shard_divisors`).

    TP: each forward all-reduce of the table, size A b / c (all-gather + reduce-scatter of the
        same size with sequence parallelism), once forward and once backward, exposed by
        (1 - tp_comm_overlap).
    CP: all-gather of K and of V over the cp group before attention (kv b / (2 t) each,
        gathered; the runtime's `context_parallel` and torch's default rotate method), exposed;
        backward reduce-scatters dK and dV, the same sizes.
    EP: two all-to-alls of tokens x top_k x hidden forward (dispatch, combine), two backward,
        over the ep group, tokens b s / c per rank (every tp rank dispatches its tokens: its
        sequence shard, b s / (t c), with SP; the whole group's with etp = tp).
    ETP (etp = tp; `autopar.runtime.expert_tensor_parallel`, Megatron's MLP pattern around the
        expert call of each MoE layer, tokens b s / c, all not overlapped): without SP an
        all-reduce of the output forward, of the input's and the routing weights' gradients
        backward; with SP the input, routing weights and indices all-gathered and the
        output reduce-scattered forward, the output's gradient all-gathered and the input's
        and weights' gradients reduce-scattered backward. Counted in the TP times.
    low precision (a recipe of `autopar.config.precision`, on the blocks it converts): each
        linear the stack runs in it (`in_recipe`: every one, or under the stack's
        `torchao_linears` those torchao converts; the rest stay in the base precision) runs
        its three GEMMs at the recipe's rate (its `gemm_dtype` peak on the matmul
        curve, FLOPs over `gemm_efficiency`); its scaling, casts and transposes are one
        memory-bound op forward and one backward of `cast_forward` / `cast_backward` x the
        linear's activation and weight bytes, times the stack's `cast_traffic`. Under MXFP8 on
        a torchao stack, an expert linear's routed rows are padded with zeros to whole blocks
        of 32 (`runtime.low_precision.mx_padded`): its GEMMs run `mx_padded_rows(R)` rows for
        the R one expert receives on a rank per micro-batch (R = its routed rows per sample
        x b / d_r x ep, d_r the "routed" divisor of `shard_divisors`: every rank of the ep
        group sends it its tokens' share, the whole tp group's where etp = tp).
    recompute: full re-runs the forward (compute and its collectives); selective re-runs the
        memory-bound ops (the matmul and attention outputs are kept); with recompute_modules,
        each named region's forward (`module_regions`: its matmuls with their casts, its
        attention and memory-bound ops) and the collectives inside it: the tp all-reduces of
        its row-parallel matmuls (their share of the layer's, SP's gather and scatter with
        them), context parallelism's with the attention, the dispatch's all-to-alls and etp's
        with the whole MoE layer; under none, a stack
        that recomputes multi-latent attention's up-projections re-runs their GEMMs
        (`CostOptions.recompute_up_projections`; the rotary's few element-wise ops not priced).
    runtime overhead (profiles measured by `autopar profile`, [runtime]): o per repeated layer
        per micro-batch, one third in the forward and two thirds in the backward (the
        backward runs two ops per forward op); full recompute pays the forward third again.
        o = o[tp_sp | tp | plain] + (o[fsdp3 | fsdp] - o[plain] under ZeRO): the
        parallel styles' extra host work (DTensor dispatch, FSDP2 hooks and copies) adds up;
        a recomputed layer adds o[policy] - o[plain] (full: less the 1/3 o[plain] its re-run
        forward already pays) to its recompute time. The model's last layer carries the
        measured overhead of everything outside the repeated layers (embedding, head, loss:
        `model_overhead_s`, combined by the same rule) per micro-batch.
    split backward (cfg.schedule in SPLIT_BACKWARD, pp > 1): torch's pipelining runs such a
        stage's backward as two autograd passes (`stage_backward_input` over the stage's
        inputs, then `stage_backward_weight` over its parameter groups), which costs the
        host more than one pass: each repeated layer per micro-batch adds
        o[split] - o[plain] (at least 0) to its weight-gradient time, except on model chunk
        0, whose stage has no input gradient and runs one full backward at its W step
        (`split_backward_overhead_s`; the estimator adds it per stage, outside the layer
        times it caches across schedules: `StageTimer.stage_times`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from autopar.config import SPLIT_BACKWARD, ParallelConfig
from autopar.config.precision import MX_BLOCK, Recipe
from autopar.estimate.memory import shard_divisors, token_ways
from autopar.estimate.module_regions import RegionTable, regions_named
from autopar.estimate.tables import LayerTable, MatmulOp
from cost_models.compute import DeviceSpec, op_time_s

CommFn = Callable[[str, float, str], float]  # (collective, bytes, axis) -> seconds


@dataclass(frozen=True)
class LayerTime:
    compute_forward_s: float
    compute_backward_s: float  # input and weight gradients
    weight_grad_s: float  # the weight-gradient part of compute_backward_s
    recompute_s: float
    tp_forward_s: float  # exposed
    tp_backward_s: float
    cp_forward_s: float
    cp_backward_s: float
    ep_forward_s: float
    ep_backward_s: float

    @property
    def forward_s(self) -> float:
        return self.compute_forward_s + self.tp_forward_s + self.cp_forward_s + self.ep_forward_s

    @property
    def backward_s(self) -> float:
        return (
            self.compute_backward_s
            + self.recompute_s
            + self.tp_backward_s
            + self.cp_backward_s
            + self.ep_backward_s
        )


def layer_time(
    table: LayerTable,
    cfg: ParallelConfig,
    device: DeviceSpec,
    dtype: str,
    act_scale: float,
    comm: CommFn,
    tp_overlap: float,
    overheads: Mapping[str, float] | None = None,
    model_overheads: Mapping[str, float] | None = None,
    *,
    memory_traffic: float = 1.0,
    recipe: Recipe | None = None,
    cast_traffic: float = 1.0,
    torchao_linears: bool = False,
    recompute_up_projections: bool = False,
    recipe_host_s: float = 0.0,
) -> LayerTime:
    """One micro-batch of ``cfg.micro_batch_size`` samples through ``table``'s layer;
    ``overheads``: the profile's `runtime_overhead_s`, ``model_overheads`` its
    `model_overhead_s`, given for the model's last layer only (module docstring);
    ``memory_traffic``: the stack's bytes of memory-bound ops per traced byte
    (`CostOptions.memory_traffic`); ``recipe``: the low-precision recipe its linears run in
    (`autopar.config.precision`), their GEMMs at its rate plus its casts' traffic, times
    ``cast_traffic`` (`CostOptions.cast_traffic`); ``torchao_linears``: only the linears
    torchao converts run in it (`CostOptions.torchao_linears`, `in_recipe`);
    ``recompute_up_projections``: under recompute "none", the up-projection GEMMs run again in
    the backward (`CostOptions.recompute_up_projections`); ``recipe_host_s``: the host's time
    per GEMM of a linear in the recipe, a floor under the layer's forward (one a linear) and
    backward (two) where the host dispatches slower than the device runs
    (`CostOptions.recipe_host_s`)."""
    b, t, c = cfg.micro_batch_size, cfg.tp, cfg.cp
    # experts: split over ep, whole on every tp rank (each runs its tokens' experts) unless
    # etp = tp
    weight_div = {"tp": t, "rep": 1, "expert": cfg.ep * cfg.etp, "whole": 1}
    flop_div = shard_divisors(cfg)
    fwd = bwd = wgrad = up_fwd = 0.0
    cast_f = cast_b = 0.0  # a recipe's scaling, casts and transposes (module docstring)
    converted = 0  # linears in the recipe
    op_fwd: list[float] = []  # each matmul's forward with its casts (a module region re-runs)
    for op in table.matmuls:
        d = flop_div[op.shard]
        acts = op.activation_bytes * b * act_scale / d
        weights = op.weight_bytes * act_scale / weight_div[op.shard]
        io = acts + weights
        low = in_recipe(op, recipe, torchao_linears)
        gemm, scale = (recipe.gemm_dtype, 1 / recipe.gemm_efficiency) if low else (dtype, 1.0)
        if low and torchao_linears and _padded_expert(op, table, recipe):
            rows = expert_rows(op) * b / flop_div["routed"] * cfg.ep
            scale *= mx_padded_rows(rows) / rows
        groups = max(1, op.groups // cfg.ep)  # this rank's experts' GEMMs
        gemm_fwd = _gemms_time(device, op.flops * b / d * scale, io, gemm, groups)
        fwd += gemm_fwd
        up_fwd += gemm_fwd if op.up_projection else 0.0
        back = _gemms_time(device, op.backward_flops * b / d * scale, 2 * io, gemm, groups)
        bwd += back
        op_fwd.append(gemm_fwd)
        if low:
            converted += 1
            (fa, fw), (ba, bw) = recipe.cast_forward, recipe.cast_backward
            op_cast = op_time_s(device, "elementwise", 0.0, (fa * acts + fw * weights)
                                * cast_traffic, "fp32")  # fmt: skip
            cast_f += op_cast
            op_fwd[-1] += op_cast
            cast_b += op_time_s(device, "elementwise", 0.0, (ba * acts + bw * weights)
                                * cast_traffic, "fp32")  # fmt: skip
        if op.backward_flops:
            wgrad += back * op.weight_grad_flops / op.backward_flops
    attn_fwd = attn_bwd = 0.0
    for op in table.attention:
        d = t * c
        io = op.io_bytes * b * act_scale / d
        op_fwd.append(op_time_s(device, "attention", op.flops * b / d, io, dtype))
        attn_fwd += op_fwd[-1]
        attn_bwd += op_time_s(device, "attention", op.backward_flops * b / d, 2 * io, dtype)
    mem = _memory_ops_time(table.memory_ops, cfg, device, act_scale * memory_traffic)
    host = runtime_overhead_s(overheads if table.kind == "block" else model_overheads, cfg)
    fwd += attn_fwd + mem + host / 3 + cast_f
    bwd += attn_bwd + 2 * mem + 2 * host / 3 + cast_b
    # the device waits for a host that dispatches the recipe's scaling op by op
    fwd = max(fwd, converted * recipe_host_s)
    bwd = max(bwd, 2 * converted * recipe_host_s)
    tp_f = _tp_comm(table, cfg, act_scale, comm) * (1 - tp_overlap)
    cp_f, cp_b = _cp_comm(table, cfg, act_scale, comm, attn_fwd, attn_bwd)
    ep = _ep_comm(table, cfg, act_scale, comm)
    etp_f, etp_b = _etp_comm(table, cfg, act_scale, comm)
    if cfg.recompute_modules:
        tp_bytes = sum(table.tp_allreduce_bytes)
        recompute = sum(
            _region_forward(r, table, cfg, device, act_scale * memory_traffic, op_fwd)
            + (tp_f * r.tp_allreduce_bytes / tp_bytes if tp_bytes else 0.0)
            + (cp_f if r.has_attention else 0.0)
            + (ep + etp_f if r.whole_moe else 0.0)
            for r in (
                table.module_regions[k]
                for k in regions_named(
                    table.module_regions, cfg.recompute_modules, recompute_up_projections
                )
            )
        )
    elif cfg.recompute == "full":
        recompute = fwd + tp_f + etp_f + cp_f + ep
    elif cfg.recompute == "selective":
        recompute = mem
    else:
        recompute = up_fwd if recompute_up_projections else 0.0
    if cfg.recompute != "none" and table.kind == "block" and not cfg.recompute_modules:
        recompute += recompute_overhead_s(overheads, cfg.recompute)
    return LayerTime(fwd, bwd, wgrad, recompute, tp_f + etp_f, tp_f + etp_b, cp_f, cp_b, ep, ep)


def _region_forward(
    region: RegionTable,
    table: LayerTable,
    cfg: ParallelConfig,
    device: DeviceSpec,
    traffic_scale: float,
    op_fwd: list[float],
) -> float:
    """The forward compute of ``region`` again: its matmuls (with a recipe's casts), its
    attention and its memory-bound ops; ``op_fwd``: the layer's matmuls' forward times, then
    its attention ops'."""
    n = len(table.matmuls)
    total = sum(op_fwd[i] for i in region.matmuls)
    total += sum(op_fwd[n + i] for i in region.attention)
    return total + _memory_ops_time(region.memory_ops, cfg, device, traffic_scale)


def in_recipe(op: MatmulOp, recipe: Recipe | None, torchao_linears: bool) -> bool:
    """Whether ``op`` runs in ``recipe`` on a block the recipe covers: a linear layer (a
    weight, not a product of activations), and with ``torchao_linears`` one torchao converts
    (`Recipe.torchao_converts`)."""
    if recipe is None or op.weight_bytes <= 0:
        return False
    return not torchao_linears or recipe.torchao_converts(op.linear)


def _padded_expert(op: MatmulOp, table: LayerTable, recipe: Recipe) -> bool:
    """Whether torchao's MXFP8 runs ``op`` on rows padded to whole blocks: an expert linear
    at its routed rows (a dispatched or routing graph's; a dense-dispatch graph without ep
    runs every token, which the planner keeps in whole blocks)."""
    return (
        recipe.gemm_dtype == "mxfp8"
        and op.shard == "expert"
        and op.linear is not None
        and table.moe_routed_fraction == 1.0
        and expert_rows(op) > 0
    )


def expert_rows(op: MatmulOp) -> float:
    """The rows per sample a linear's forward GEMM runs: its FLOPs over 2 x in x out."""
    assert op.linear is not None
    in_features, out_features, _ = op.linear
    return op.flops / (2 * in_features * out_features)


def mx_padded_rows(rows: float) -> float:
    """The expected rows one expert's GEMMs run once its routed rows are padded to whole
    `MX_BLOCK` blocks, for a mean of ``rows`` (the counts vary per expert and step): the count
    taken as Poisson (each token's choice of an expert an independent rare event), an empty
    expert running none; past 4096 rows a remainder taken as uniform, (MX_BLOCK - 1) / 2."""
    if rows <= 0:
        return 0.0
    if rows > 4096:
        return rows + (MX_BLOCK - 1) / 2
    top = int(rows + 12 * math.sqrt(rows) + 2 * MX_BLOCK)
    log_rows = math.log(rows)
    return sum(
        math.exp(n * log_rows - rows - math.lgamma(n + 1)) * -(-n // MX_BLOCK) * MX_BLOCK
        for n in range(1, top)
    )


def _gemms_time(device: DeviceSpec, flops: float, io: float, dtype: str, groups: int) -> float:
    """``groups`` equal GEMMs of ``flops`` and ``io`` bytes in all, as one launch (a grouped
    GEMM): each at the matmul efficiency of its own size (module docstring)."""
    if groups == 1:
        return op_time_s(device, "matmul", flops, io, dtype)
    one = op_time_s(device, "matmul", flops / groups, io / groups, dtype)
    return groups * (one - device.launch_overhead_s) + device.launch_overhead_s


def runtime_overhead_s(overheads: Mapping[str, float] | None, cfg: ParallelConfig) -> float:
    """Per repeated layer per micro-batch, forward and backward: the styles ``cfg`` runs in,
    combined as the module docstring says; 0 without measured overheads."""
    if not overheads:
        return 0.0
    plain = overheads.get("plain", 0.0)
    if cfg.tp > 1:
        total = overheads.get("tp_sp" if cfg.sequence_parallel else "tp", plain)
    else:
        total = plain
    if cfg.zero_stage:
        # under a pipeline the runtime's ZeRO-3 keeps its units gathered, as ZeRO-1/2 do
        # (`autopar.runtime.data_parallel`): their style
        zero3 = cfg.zero_stage == 3 and cfg.pp == 1
        total += overheads.get("fsdp3" if zero3 else "fsdp", plain) - plain
    return max(0.0, total)


def split_backward_overhead_s(overheads: Mapping[str, float] | None, cfg: ParallelConfig) -> float:
    """Per repeated layer per micro-batch outside model chunk 0, what splitting the backward
    into input and weight passes costs the host (module docstring): o[split] - o[plain], at
    least 0; 0 unless ``cfg`` pipelines with a split-backward schedule and "split" was
    measured."""
    if cfg.pp == 1 or cfg.schedule not in SPLIT_BACKWARD or "split" not in (overheads or {}):
        return 0.0
    return max(0.0, overheads["split"] - overheads.get("plain", 0.0))


def recompute_overhead_s(overheads: Mapping[str, float] | None, policy: str) -> float:
    """What a layer recomputed under ``policy`` costs the host beyond what the re-run forward
    pays (full: a third of the plain overhead again; selective: nothing is priced): the
    measured style's overhead less those, at least 0 (torch's selective checkpoint runs a
    Python dispatch mode over every op, forward and re-run)."""
    if not overheads or policy not in overheads:
        return 0.0
    plain = overheads.get("plain", 0.0)
    return max(0.0, overheads[policy] - plain * (4 / 3 if policy == "full" else 1))


def _memory_ops_time(
    memory_ops: tuple[tuple[str, float, int], ...],
    cfg: ParallelConfig,
    device: DeviceSpec,
    act_scale: float,
) -> float:
    div = shard_divisors(cfg)
    total = 0.0
    for shard, nbytes, count in memory_ops:
        per_op = nbytes * cfg.micro_batch_size * act_scale / div[shard] / count
        total += count * op_time_s(device, "elementwise", 0.0, per_op, "fp32")
    return total


def _tp_comm(table: LayerTable, cfg: ParallelConfig, act_scale: float, comm: CommFn) -> float:
    if cfg.tp == 1:
        return 0.0
    total = 0.0
    for size in table.tp_allreduce_bytes:
        nbytes = size * cfg.micro_batch_size * act_scale / cfg.cp
        if cfg.sequence_parallel:
            total += comm("all_gather", nbytes, "tp") + comm("reduce_scatter", nbytes, "tp")
        else:
            total += comm("all_reduce", nbytes, "tp")
    return total


def _cp_comm(
    table: LayerTable,
    cfg: ParallelConfig,
    act_scale: float,
    comm: CommFn,
    attn_fwd: float = 0.0,
    attn_bwd: float = 0.0,
) -> tuple[float, float]:
    """Forward and backward seconds of context parallelism's attention traffic, exposed:
    all_gather, K and V gathered before attention and dK, dV reduce-scattered after it, none
    hidden; ring, cp - 1 steps that each pass a rank's K and V block to its neighbour (in
    the backward K and V again and the dK, dV partial sums), each step beside one block's
    attention (``attn_fwd`` / cp of the layer's), only its excess exposed."""
    if cfg.cp == 1 or not table.attention:
        return 0.0, 0.0
    fwd = bwd = 0.0
    c = cfg.cp
    for op in table.attention:
        gathered = op.kv_sent_bytes * cfg.micro_batch_size * act_scale / (2 * cfg.tp)  # K or V
        if cfg.cp_attention == "ring":
            block = gathered / c  # one rank's K (or V)
            fwd += (c - 1) * max(0.0, comm("send_recv", 2 * block, "cp") - attn_fwd / c)
            bwd += (c - 1) * max(0.0, comm("send_recv", 4 * block, "cp") - attn_bwd / c)
        else:
            fwd += 2 * comm("all_gather", gathered, "cp")
            bwd += 2 * comm("reduce_scatter", gathered, "cp")
    return fwd, bwd


def _ep_comm(table: LayerTable, cfg: ParallelConfig, act_scale: float, comm: CommFn) -> float:
    if cfg.ep == 1 or not table.moe_num_experts:
        return 0.0
    payload = table.moe_dispatch_bytes * cfg.micro_batch_size * act_scale / dispatch_ways(cfg)
    return 2 * comm("all_to_all", payload, "ep")


def _etp_comm(
    table: LayerTable, cfg: ParallelConfig, act_scale: float, comm: CommFn
) -> tuple[float, float]:
    """Forward and backward seconds of expert tensor parallelism's collectives (module
    docstring, `expert_tp_collectives`)."""
    calls = expert_tp_collectives(table, cfg, act_scale)
    fwd = sum(comm(kind, nbytes, "tp") for kind, nbytes, forward in calls if forward)
    bwd = sum(comm(kind, nbytes, "tp") for kind, nbytes, forward in calls if not forward)
    return fwd, bwd


def dispatch_ways(cfg: ParallelConfig) -> int:
    """What divides a sample's tokens each rank dispatches to the experts: `token_ways` (its
    own sequence shard), or cp where etp = tp (the tp group's tokens, gathered)."""
    return cfg.cp if cfg.etp > 1 else token_ways(cfg)


def expert_tp_collectives(
    table: LayerTable, cfg: ParallelConfig, act_scale: float
) -> list[tuple[str, float, bool]]:
    """(kind, bytes, forward?) of one micro-batch's expert tensor parallelism over tp in an
    MoE layer, once each (module docstring): empty unless etp > 1. Bytes as the tensors
    gathered or reduced are whole: b s / c tokens."""
    if cfg.etp == 1 or not table.moe_num_experts:
        return []
    scale = cfg.micro_batch_size / cfg.cp
    hidden = table.moe_hidden_bytes * scale * act_scale
    # the MoEBlock's weights are in the model's dtype; a stack's fp32 and its indices int64
    weights = table.moe_weights_bytes * scale * (1.0 if table.moe_index_bytes else act_scale)
    if not cfg.sequence_parallel:
        return [("all_reduce", hidden, True), ("all_reduce", hidden, False),
                ("all_reduce", weights, False)]  # fmt: skip
    calls = [("all_gather", hidden, True), ("all_gather", weights, True),
             ("reduce_scatter", hidden, True), ("all_gather", hidden, False),
             ("reduce_scatter", hidden, False), ("reduce_scatter", weights, False)]  # fmt: skip
    if table.moe_index_bytes:
        calls.append(("all_gather", table.moe_index_bytes * scale, True))
    return calls
