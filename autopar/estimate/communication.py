"""The collectives one training step issues, per pipeline stage: what the program must do.

In: the model's `ModelTables`, a `ParallelConfig`, the layers of each stage, the number of
micro-batches m, the precision. Out: per stage a tuple of `PlannedCollective` -- part, kind,
mesh axis, calls per step on one rank of the stage, bytes per call -- the figures a run's
collectives are checked against (tests/autopar/runtime/test_plan_fidelity.py) and that
`Plan.communication` records.

Bytes per call are the whole buffer: an all-reduce's tensor, an all-gather's gathered output,
a reduce-scatter's input (the sizes `cost_models.comm` prices). With b the micro-batch size,
x = act_scale (training over traced element bytes), c = cp, A an entry of a layer's
`tp_allreduce_bytes`, P(L) the parameters of layers L on the rank (`params_on_rank`), w the
training element bytes and g the gradient element bytes:

    tp      no SP: all-reduce of A b x / c, twice per micro-batch (Megatron's f and g: once
            forward, once backward); a block under full recompute (with recompute_layers k:
            the first k blocks of each chunk, `_recomputed_blocks`) runs its forward's again
            up to its last saved tensor (torch's checkpoint stops early): three times but for
            the block's last entry; SP: all-gather and reduce-scatter of A b x / c, each twice
            per micro-batch (recomputed: one more all-gather, and reduce-scatter but for the
            last entry). The token embedding's entry is the vocabulary-parallel lookup's
            all-reduce forward and the column-parallel head's input-gradient all-reduce
            backward (SP: its reduce-scatter and the head's all-gather, Megatron's ends; where
            the runtime splits the sequence at the first block and gathers it after the last,
            `ModelTables.split_sequence_ends`, the two all-reduces and an all-gather at each
            end, and the final norm runs whole);
            where the stack leaves them whole (`memory.vocab_whole`: autopar's runtime with
            cp > 1) neither has collectives and the loss is not vocabulary-parallel.
    loss    vocabulary-parallel cross entropy (torch's loss_parallel): three all-reduces per
            micro-batch (max, sum of exponentials, target logit) of b s fp32 values (next-token
            losses read s - 1 positions: an upper bound).
    sp      the replicated parameters inside the sequence-parallel region (norms, row-parallel
            biases) get partial gradients: one all-reduce of their P g per step, flattened.
    fsdp    FSDP2 units: each block, the token embedding and the LM head of a vocabulary
            pair each a unit of their own where each is one module with parameters no other
            layer reads (`fsdp_end_units`, the runtime's `data_parallel.end_units`: untied),
            and the stage's other layers together (the root).
            ZeRO-3: a block or the embedding is all-gathered forward and again backward (2m),
            the head and the root once per micro-batch (they stay gathered until their
            backward, m); ZeRO-1/2: every unit m. Under a pipeline (pp > 1) every unit once a
            step, and its gradients reduce-scattered once (torch's pipelining keeps a chunk
            gathered and its gradients unsharded from its first backward to the step's end;
            the runtime does not reshard after forward there: `runtime.data_parallel`).
            Reduce-scatter of each unit's gradients: m (ZeRO-2/3) or 1 (ZeRO-1, or pp > 1).
            Bytes: P(unit) w gathered, P(unit) g reduce-scattered; HSDP adds an all-reduce
            over dp of the P(unit) g / fsdp shard after each reduce-scatter.
    dp      replicated data parallelism: P g summed once per step, a flat buffer all-reduced in
            chunks of at most 25 MiB (`cost_models.comm.flat_chunks`; so every flat gradient
            sum below);
            with ep > 1 the experts are left out of it (P_dense g, `dense_params_on_rank`).
    cp      context parallelism, all-gather-KV attention (`autopar.runtime.context_parallel`,
            torch's default rotate method; `layer_cost._cp_comm` prices the same): per
            attention op of kv bytes K + V per sample, K and V all-gathered over cp forward,
            kv b x / (2 t) each gathered (twice per micro-batch, four times with full
            recompute), dK and dV reduce-scattered backward (twice per micro-batch). The loss
            of a micro-batch is all-reduced over cp (one fp32 scalar, on the stage with the
            last layer), and every gradient is summed over cp once per step (P g, divided by
            fsdp where FSDP shards the gradients).
    ep      expert parallelism, all-to-all token dispatch (`autopar.runtime.expert_parallel`):
            per MoE layer and micro-batch, one all-to-all of the E per-expert row counts
            (int64, 8 E bytes; forward only), and the routed rows, D b x / w bytes with D
            the layer's `moe_dispatch_bytes` (tokens x top_k x hidden): dispatch and combine
            forward, their adjoints backward, so 4 per micro-batch (6 with full recompute,
            which re-runs the forward's 2 and the counts); w = c, or c t with SP unless etp =
            tp (`layer_cost.dispatch_ways`). The rows one rank sends in the
            combine and the dispatch's adjoint are those routed to it: the bytes are the mean
            over the ep group (balanced routing), exact on every rank for the other two.
            ep folds over the dp x fsdp x cp ranks, cp innermost (the cp gradient sum leaves
            the experts out). Expert gradients are summed over the ranks holding the same
            experts (dp x fsdp x cp / ep of them, axis "expert_dp") when there are more than
            one: P_expert g; with fsdp > 1 each MoE layer's experts are an FSDP unit of their
            own over those ranks instead (gathered and reduce-scattered as a block is, over
            "expert_dp"; nothing where they are one rank), and the block's unit holds the
            rest.
    etp     expert tensor parallelism (etp = tp): per MoE layer and micro-batch the collectives
            over tp of `layer_cost.expert_tp_collectives`, the forward ones twice with full
            recompute.
    clip    the global gradient norm and the loss: one all-reduce of 16 bytes over the world.
    pp      pipeline parallelism (`autopar.runtime.pipeline`, torch.distributed.pipelining):
            the model chunks are the runs of consecutive layers of a stage (`_chunk_runs`;
            a V schedule's two middle chunks on the last stage are one run, torch hands their
            activations over in memory). Across each cut between runs on different stages,
            per micro-batch the forward activation (the hidden states, b S H w_a / (c t_sp),
            w_a = traced float bytes x act_scale, t_sp = t with SP, else 1,
            `memory.sequence_ends_gathered`) goes downstream and its gradient (same bytes)
            upstream: the earlier stage sends m and receives m, the later one receives m and
            sends m; one isend or irecv per tensor (gloo does not coalesce batch_isend_irecv).
            Each step
            the last chunk's loss (one fp32) is broadcast over pp, and a tied embedding whose
            first and last chunks lie on different stages has its gradient all-reduced
            between the two (T g / t, T the tied elements, divided by fsdp where FSDP shards
            the gradients; whole, T g, where the vocabulary is not split). With SP where the
            stack gathers the sequence at each chunk's ends (autopar's runtime:
            `CostOptions.pipeline_sends_sequence_shards` false) t_sp = 1, and each chunk of a
            stage all-gathers the sequence twice per micro-batch (its output forward, its
            input's gradient backward; the final norm then runs whole, outside the sp sum).
            Not counted: the shape-inference messages the first step sends (pickled metadata
            by send_object_list, once per run, not per step).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass
from itertools import pairwise

from autopar.config import ParallelConfig
from autopar.estimate.as_run import whole_vocabulary
from autopar.estimate.layer_cost import dispatch_ways, expert_tp_collectives
from autopar.estimate.memory import (
    PRECISION_BYTES,
    dense_params_on_rank,
    expert_replicas,
    expert_shard_ways,
    params_on_rank,
    shared_out_experts,
    tied_elements,
    token_summed_params,
    token_ways,
)
from autopar.estimate.tables import LayerTable, ModelTables
from cost_models.comm import flat_chunks

# Training element bytes: FSDP gathers the weights in the training precision.


@dataclass(frozen=True)
class PlannedCollective:
    """``count`` calls of ``kind`` over mesh ``axis`` per step, ``bytes`` each."""

    part: str  # "tp", "loss", "sp", "fsdp", "dp", "cp", "ep", "etp", "clip", "pp"
    kind: str  # "all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast",
    # "send", "recv" (pipeline point-to-point: count sends or receives of one rank)
    axis: str  # "tp", "fsdp", "dp", "cp", "ep", "expert_dp", "world"
    count: int
    bytes: float
    layer: str = ""  # the layer (or FSDP unit) it belongs to

    def as_dict(self) -> dict:
        return asdict(self)


def stage_communication(
    tables: ModelTables,
    cfg: ParallelConfig,
    stage_layers: list[tuple[str, ...]],
    num_microbatches: int,
    *,
    precision: str,
    grad_bytes: int,
    act_scale: float,
    vocab_whole: bool = False,
    ends_gathered: bool = False,
) -> tuple[tuple[PlannedCollective, ...], ...]:
    """Per stage, the collectives of one step on one of its ranks (module docstring);
    ``vocab_whole``: the embedding and head run whole on every tp rank (`memory.vocab_whole`);
    ``ends_gathered``: each model chunk gathers the sequence at its ends under SP
    (`memory.sequence_ends_gathered`), so stages send the whole sequence."""
    weight_bytes = PRECISION_BYTES[precision]
    as_run = whole_vocabulary if vocab_whole else (lambda t: t)
    by_name = {t.name: as_run(t) for t in tables.layers}
    last = tables.layers[-1].name if tables.layers else ""
    out = []
    ways = cfg.cp if ends_gathered else token_ways(cfg)
    ends = fsdp_end_units(tables)
    for names in stage_layers:
        layers = [by_name[n] for n in names]
        m, g, x = num_microbatches, grad_bytes, act_scale
        stage = _tensor_parallel(tables, cfg, layers, m, g, x, ends_gathered)
        stage += _context_parallel(cfg, layers, m, g, x, holds_loss=last in names)
        stage += _expert_parallel(cfg, layers, m, x)
        stage += _expert_tensor_parallel(cfg, layers, m, x)
        stage += _data_parallel(cfg, layers, m, weight_bytes, g, ends)
        stage += _pipeline(tables, cfg, stage_layers, len(out), m, g, x, vocab_whole, ways)
        if cfg.world_size > 1:
            stage.append(PlannedCollective("clip", "all_reduce", "world", 1, 16.0, "norm and loss"))
        out.append(tuple(stage))
    return tuple(out)


def _chunk_runs(tables: ModelTables, stage_layers: list[tuple[str, ...]]) -> list[tuple[int, int]]:
    """(stage, index of its last layer) of each run of consecutive layers on one stage, in
    model order: the model chunks as the runtime cuts them, a V's two chunks on the last
    stage merged (torch passes their activation in memory)."""
    stage_of = {name: s for s, names in enumerate(stage_layers) for name in names}
    runs: list[tuple[int, int]] = []
    for i, t in enumerate(tables.layers):
        s = stage_of.get(t.name)
        if s is None:
            continue
        if runs and runs[-1][0] == s:
            runs[-1] = (s, i)
        else:
            runs.append((s, i))
    return runs


def _pipeline(
    tables: ModelTables,
    cfg: ParallelConfig,
    stage_layers: list[tuple[str, ...]],
    here: int,
    m: int,
    g: int,
    x: float,
    vocab_whole: bool = False,
    div: int = 1,
) -> list[PlannedCollective]:
    out: list[PlannedCollective] = []
    if cfg.pp == 1:
        return out
    runs = _chunk_runs(tables, stage_layers)
    hidden = tables.seq_len * tables.hidden * tables.traced_float_bytes
    nbytes = hidden * cfg.micro_batch_size * x / div
    if div < token_ways(cfg):  # SP: each chunk on this stage gathers at its end, splits at
        # its start (the all-gather of its output forward, of its input's gradient backward)
        calls = 2 * m * cfg.virtual_stages
        out.append(PlannedCollective("tp", "all_gather", "tp", calls, nbytes, "chunk ends"))
    for (a, i), (b, _) in pairwise(runs):
        cut = f"after {tables.layers[i].name}"
        if here == a:  # activations down, their gradients back
            out.append(PlannedCollective("pp", "send", "pp", m, nbytes, cut))
            out.append(PlannedCollective("pp", "recv", "pp", m, nbytes, cut))
        if here == b:
            out.append(PlannedCollective("pp", "recv", "pp", m, nbytes, cut))
            out.append(PlannedCollective("pp", "send", "pp", m, nbytes, cut))
    out.append(PlannedCollective("pp", "broadcast", "pp", 1, 4.0, "loss"))
    first, last = runs[0][0], runs[-1][0]
    tied = tied_elements(tables)
    if tied and first != last and here in (first, last):
        sharded = cfg.fsdp if cfg.fsdp > 1 and cfg.zero_stage >= 1 else 1
        grads = tied / (1 if vocab_whole else cfg.tp) * g / sharded
        out.append(PlannedCollective("pp", "all_reduce", "pp", 1, grads, "tied embedding"))
    return out


def _recomputed_blocks(
    tables: ModelTables, cfg: ParallelConfig, layers: list[LayerTable]
) -> set[str]:
    """The stage's blocks that recompute: all, or the first recompute_layers of each of its
    chunks (a chunk: a run of consecutive blocks of the model; a stage's chunks are apart)."""
    blocks = [t for t in layers if t.kind == "block"]
    if cfg.recompute_layers is None:
        return {t.name for t in blocks}
    index = {t.name: i for i, t in enumerate(tables.layers)}
    out, run, last = set(), 0, -2
    for t in blocks:
        run = run + 1 if index[t.name] == last + 1 else 1
        last = index[t.name]
        if run <= cfg.recompute_layers:
            out.add(t.name)
    return out


def _tensor_parallel(
    tables: ModelTables,
    cfg: ParallelConfig,
    layers: list[LayerTable],
    m: int,
    g: int,
    x: float,
    ends_gathered: bool = False,
) -> list[PlannedCollective]:
    out: list[PlannedCollective] = []
    if cfg.tp == 1:
        return out
    b = cfg.micro_batch_size
    has_blocks = any(t.kind == "block" for t in tables.layers)
    recomputed = _recomputed_blocks(tables, cfg, layers)
    # under pp the embedding's stage and the head's stage each issue half of the vocabulary
    # pair's collectives (`_vocab_half`)
    embedding = next((e for e in tables.layers if e.token_embedding), None)
    parted = cfg.pp > 1 and embedding is not None
    for t in layers:
        again = cfg.recompute == "full" and t.name in recomputed
        if parted and t.vocab_logits_bytes and t.vocab_split:
            out += _vocab_half(cfg, embedding, m, b * x / cfg.cp, ends_gathered, t.name)
        if parted and t.token_embedding:
            if t.vocab_split:
                out += _vocab_half(cfg, t, m, b * x / cfg.cp, ends_gathered, t.name)
            continue
        if ends_gathered and t.token_embedding:  # pp = 1 here (pp > 1: `parted`)
            # the lookup's and the head's all-reduces, the first block's split and the last
            # one's gather (an all-gather each way), not Megatron's reduce-scatter at the ends
            for size in t.tp_allreduce_bytes:
                nbytes = size * b * x / cfg.cp
                out.append(PlannedCollective("tp", "all_reduce", "tp", 2 * m, nbytes, t.name))
                out.append(PlannedCollective("tp", "all_gather", "tp", 2 * m, nbytes, t.name))
            continue
        for i, size in enumerate(t.tp_allreduce_bytes):
            nbytes = size * b * x / cfg.cp
            # a recomputed block runs its forward collectives again up to its last saved
            # tensor (torch's checkpoint stops early): all but the last row output's
            last = i == len(t.tp_allreduce_bytes) - 1
            if cfg.sequence_parallel:
                gathers, scatters = (3 * m, (2 if last else 3) * m) if again else (2 * m, 2 * m)
                out.append(PlannedCollective("tp", "all_gather", "tp", gathers, nbytes, t.name))
                out.append(
                    PlannedCollective("tp", "reduce_scatter", "tp", scatters, nbytes, t.name)
                )
            else:
                calls = (2 if last or not again else 3) * m
                out.append(PlannedCollective("tp", "all_reduce", "tp", calls, nbytes, t.name))
        if t.vocab_logits_bytes and t.vocab_split and has_blocks:  # vocabulary-parallel head
            tokens = b * tables.seq_len / cfg.cp
            out.append(PlannedCollective("loss", "all_reduce", "tp", 3 * m, 4 * tokens, t.name))
    if cfg.sequence_parallel:
        sp_layers = _sequence_parallel_layers(layers, final_norm=not ends_gathered)
        # the norms' weights: routers and row-parallel biases are not summed here (the bias
        # meets the whole gradient: the reduce-scatter's backward gathers it)
        rep = sum(t.params_rep - t.params_router - t.params_row_bias for t in sp_layers) * g
        if rep:
            out.append(PlannedCollective("sp", "all_reduce", "tp", 1, rep, "norms"))
        summed = token_summed_params(cfg, layers) * g  # routers and experts on shards
        if summed:
            out += _flat_all_reduces("sp", "tp", summed, "routers, experts")
    return out


def _context_parallel(
    cfg: ParallelConfig, layers: list[LayerTable], m: int, g: int, x: float, holds_loss: bool
) -> list[PlannedCollective]:
    out: list[PlannedCollective] = []
    if cfg.cp == 1:
        return out
    for t in layers:
        forwards = 2 if cfg.recompute == "full" and t.kind == "block" else 1
        for op in t.attention:
            gathered = op.kv_sent_bytes * cfg.micro_batch_size * x / (2 * cfg.tp)  # K or V
            out.append(
                PlannedCollective("cp", "all_gather", "cp", 2 * forwards * m, gathered, t.name)
            )
            out.append(PlannedCollective("cp", "reduce_scatter", "cp", 2 * m, gathered, t.name))
    if holds_loss:  # the micro-batch's loss, summed over the sequence shards
        out.append(PlannedCollective("cp", "all_reduce", "cp", m, 4.0, "loss"))
    sharded = cfg.fsdp if cfg.fsdp > 1 and cfg.zero_stage >= 1 else 1
    # with ep > 1 the experts fold over cp: summed over their replicas instead (expert_dp)
    params = dense_params_on_rank(cfg, layers) if cfg.ep > 1 else params_on_rank(cfg, layers)
    grads = params * g / sharded
    if grads:
        out += _flat_all_reduces("cp", "cp", grads, "gradients")
    return out


def _expert_tensor_parallel(
    cfg: ParallelConfig, layers: list[LayerTable], m: int, x: float
) -> list[PlannedCollective]:
    out: list[PlannedCollective] = []
    forwards = 2 if cfg.recompute == "full" else 1
    for t in layers:
        calls = Counter(expert_tp_collectives(t, cfg, x))
        for (kind, nbytes, forward), n in calls.items():
            count = n * (forwards if forward else 1) * m
            out.append(PlannedCollective("etp", kind, "tp", count, nbytes, t.name))
    return out


def _expert_parallel(
    cfg: ParallelConfig, layers: list[LayerTable], m: int, x: float
) -> list[PlannedCollective]:
    out: list[PlannedCollective] = []
    if cfg.ep == 1:
        return out
    for t in layers:
        if not t.moe_num_experts:
            continue
        forwards = 2 if cfg.recompute == "full" else 1
        rows = t.moe_dispatch_bytes * cfg.micro_batch_size * x / dispatch_ways(cfg)
        counts = 8.0 * t.moe_num_experts  # int64 rows per expert
        out.append(PlannedCollective("ep", "all_to_all", "ep", forwards * m, counts, t.name))
        out.append(
            PlannedCollective("ep", "all_to_all", "ep", (2 * forwards + 2) * m, rows, t.name)
        )
    return out


def fsdp_end_units(tables: ModelTables) -> tuple[str | None, str | None]:
    """(token embedding, LM head): the layers outside the blocks that FSDP2 makes units of
    their own (as torchtitan does), None where one stays in the root. A vocabulary pair's
    embedding (an ``nn.Embedding`` layer) and head (an ``nn.Linear`` layer with as many rows
    as the vocabulary), neither tied to the other: a tied weight stays in the root, where
    both find it gathered. The runtime's rule is the same (`runtime.data_parallel.end_units`,
    on the module tree)."""
    embeddings = [t for t in tables.layers if t.token_embedding]
    heads = [t for t in tables.layers if t.vocab_logits_bytes and t.vocab_split]
    if not embeddings or not heads or tied_elements(tables):
        return None, None
    embedding, head = embeddings[0], heads[-1]
    return (
        embedding.name if embedding.module_type == "Embedding" else None,
        head.name if head.module_type == "Linear" else None,
    )


def _data_parallel(
    cfg: ParallelConfig,
    layers: list[LayerTable],
    m: int,
    w: int,
    g: int,
    end_units: tuple[str | None, str | None] = (None, None),
) -> list[PlannedCollective]:
    out: list[PlannedCollective] = []
    if cfg.fsdp > 1 and cfg.zero_stage >= 1:
        # gathers per micro-batch: twice where resharded after forward; under a pipeline
        # each unit stays gathered, its gradients unsharded, over the whole step: once a step
        per_mb = m if cfg.pp == 1 else 1
        twice = 2 if cfg.zero_stage == 3 and cfg.pp == 1 else 1
        embedding, head = end_units
        units = [(t.name, [t], twice) for t in layers if t.kind == "block"]
        units += [(t.name, [t], twice) for t in layers if t.name == embedding]
        units += [(t.name, [t], 1) for t in layers if t.name == head]
        root = [t for t in layers if t.kind != "block" and t.name not in end_units]
        if root and params_on_rank(cfg, root):
            units.append(("<root>", root, 1))
        scatters = per_mb if cfg.zero_stage >= 2 else 1
        experts_sharded = cfg.ep > 1 and expert_shard_ways(cfg) > 1
        for name, unit, gathers in units:
            experts = shared_out_experts(cfg, unit)
            p = params_on_rank(cfg, unit) - experts
            out.append(
                PlannedCollective("fsdp", "all_gather", "fsdp", gathers * per_mb, p * w, name)
            )
            out.append(PlannedCollective("fsdp", "reduce_scatter", "fsdp", scatters, p * g, name))
            if cfg.dp > 1:
                shard = p * g / cfg.fsdp
                out.append(PlannedCollective("fsdp", "all_reduce", "dp", scatters, shard, name))
            if experts and experts_sharded:  # the layer's experts: their own unit
                e_w, e_g = experts * w, experts * g
                out.append(
                    PlannedCollective("ep", "all_gather", "expert_dp", gathers * per_mb, e_w, name)
                )
                out.append(
                    PlannedCollective("ep", "reduce_scatter", "expert_dp", scatters, e_g, name)
                )
        return out
    # expert parallelism: the experts are summed over their replicas only (expert_dp)
    if cfg.dp > 1:
        p = dense_params_on_rank(cfg, layers) if cfg.ep > 1 else params_on_rank(cfg, layers)
        out += _flat_all_reduces("dp", "dp", p * g, "gradients")
    experts = shared_out_experts(cfg, layers) * g
    if experts and expert_replicas(cfg) > 1:
        out += _flat_all_reduces("ep", "expert_dp", experts, "experts")
    return out


def _flat_all_reduces(part: str, axis: str, nbytes: float, name: str) -> list[PlannedCollective]:
    """The all-reduces that sum a flat gradient buffer of ``nbytes`` over ``axis``: chunks of
    `cost_models.comm.flat_chunks`' sizes, as the runtime's `all_reduce_flat` sends them."""
    sizes = Counter(flat_chunks(nbytes))
    return [PlannedCollective(part, "all_reduce", axis, n, size, name) for size, n in sizes.items()]


def _vocab_half(
    cfg: ParallelConfig,
    embedding: LayerTable,
    m: int,
    scale: float,
    ends_gathered: bool,
    layer: str,
) -> list[PlannedCollective]:
    """Under pp the embedding's stage and the head's stage each issue half of the vocabulary
    pair's collectives, m per micro-batch: the lookup's all-reduce forward, the head's
    input-gradient all-reduce backward; with SP at Megatron's ends, a reduce-scatter and an
    all-gather on each (where chunks gather their ends, the all-reduces)."""
    nbytes = sum(embedding.tp_allreduce_bytes) * scale
    if cfg.sequence_parallel and not ends_gathered:
        return [
            PlannedCollective("tp", "all_gather", "tp", m, nbytes, layer),
            PlannedCollective("tp", "reduce_scatter", "tp", m, nbytes, layer),
        ]
    return [PlannedCollective("tp", "all_reduce", "tp", m, nbytes, layer)]


def _sequence_parallel_layers(
    layers: list[LayerTable], final_norm: bool = True
) -> list[LayerTable]:
    """The blocks and, with ``final_norm``, the final norm after them (the layer between the
    last block and the head holding only replicated parameters): the layers that run on
    sequence shards."""
    blocks = [i for i, t in enumerate(layers) if t.kind == "block"]
    if not blocks:
        return []
    after = [
        t
        for t in layers[blocks[-1] + 1 :]
        if t.params_rep and not t.params_tp and not t.vocab_logits_bytes
    ]
    return [layers[i] for i in blocks] + (after[:1] if final_norm else [])


def as_text(collectives: tuple[PlannedCollective, ...]) -> str:
    """One line per (part, kind, axis, bytes): calls per step and total bytes."""
    totals: dict[tuple[str, str, str, float], int] = {}
    for c in collectives:
        key = (c.part, c.kind, c.axis, c.bytes)
        totals[key] = totals.get(key, 0) + c.count
    return "\n".join(
        f"{part:5} {kind:15} over {axis:5} {count:4} x {nbytes:12.0f} B"
        for (part, kind, axis, nbytes), count in sorted(totals.items())
    )
