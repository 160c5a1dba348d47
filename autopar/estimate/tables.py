"""Per-layer cost tables: a ModelGraph -> the numbers the step estimator multiplies.

Built once per model and shape, read by every config the search prices; per sample, per layer.

Tensor-parallel classes come from a Megatron-style propagation over each layer's nodes, in
graph order: values from other layers are replicated ("rep"); a matmul with a weight that reads
a replicated activation is column-parallel and makes a sharded ("tp") value; one that reads a
sharded activation is row-parallel, makes a replicated value and costs one all-reduce of its
output (Megatron's f/g pair: one all-reduce forward, one backward); a vocab-parallel embedding
also costs one; any other op is sharded when one of its inputs is. Ops inside experts are
"expert" (sharded by expert parallelism); the router stays replicated. Outside the blocks only
the vocabulary head splits (BERT's MLM transform, ViT's classifier stay whole). A saved
replicated value that a column-parallel matmul reads is "gathered": SP all-gathers it, and
the stack decides whether the whole sequence or the shard is kept (`memory.shard_divisors`).
The same walk gives the runtime its column/row roles (`tensor_parallel_roles`).

Experts of a dense-dispatch MoE (`autopar.models.moe`: every expert on every token, so the
graph is exportable) are tabled as traced, which is what the runtime runs without expert
parallelism; `as_run.routed_layer` gives the same layer at the top-k routed rows (the work times
top_k / num_experts), which is what the all-to-all dispatch of expert parallelism runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from autopar.estimate.graph_values import unrepeated_bytes, weight_copies
from autopar.estimate.kernel_savings import fused_kernel_surplus, norm_upcasts, up_projection_region
from autopar.estimate.module_regions import RegionTable, block_regions, region_tables
from autopar.estimate.saved_split import DTYPE_BYTES, activation_split, value_bytes
from autopar.tracing.graph import LayerInfo, ModelGraph, NodeInfo

# "tp" | "rep" | "expert" | "whole" (a vocabulary layer TP leaves whole) | "gathered" | "routed"
# (a dispatch's rows, `as_run.routed_layer`)
Shard = str


@dataclass(frozen=True)
class MatmulOp:
    flops: float  # forward, per sample
    backward_flops: float
    weight_grad_flops: float  # the part of backward_flops that is the weight gradient
    activation_bytes: float  # per sample (inputs + output without the weight)
    weight_bytes: float
    shard: Shard
    # the GEMMs the op runs, one per expert of a stacked expert layer (a grouped or batched
    # matmul over every expert of a graph that routes), else 1: each priced at its own size
    groups: int = 1
    # the nn.Linear that runs it (`ModelGraph.linears`), None for any other module: whether
    # torchao converts it under a recipe (`Recipe.torchao_converts`)
    linear: tuple[int, int, bool] | None = None
    up_projection: bool = False  # MLA's (`kernel_savings`), re-run where a stack recomputes it


@dataclass(frozen=True)
class AttentionOp:
    flops: float
    backward_flops: float
    kv_bytes: float  # keys + values, per sample (at the traced precision)
    io_bytes: float
    # keys + values as context parallelism sends them: before a GQA repeat to the query heads
    # (`graph_values.unrepeated_bytes`), as the runtime and Megatron/TransformerEngine exchange them
    kv_sent_bytes: float


@dataclass(frozen=True)
class LayerTable:
    name: str
    class_id: str
    kind: str
    matmuls: tuple[MatmulOp, ...]
    attention: tuple[AttentionOp, ...]
    memory_ops: tuple[tuple[Shard, float, int], ...]  # (shard, bytes per sample, op count)
    tp_allreduce_bytes: tuple[float, ...]  # forward all-reduces (per sample); backward mirrors
    params_tp: int
    params_rep: int
    params_expert: int
    num_param_tensors: int
    params_router: int  # the MoE router's, counted in params_rep too
    # saved bytes {policy: {shard: per sample}}; "-up_proj", "-fused": parts of "none" some
    # stacks do not keep, "+fp32" one kept in fp32 in any precision (`kernel_savings`)
    activations: dict[str, dict[Shard, float]]
    output_bytes: float  # what a pipeline cut after this layer sends, per sample
    moe_num_experts: int = 0
    moe_top_k: int = 0
    moe_dispatch_bytes: float = 0.0  # one all-to-all's payload, per sample (tokens*k*h)
    # what the layer's expert call takes, per sample (etp gathers or copies it over tp): the
    # hidden rows (tokens*h, traced precision), the routing weights (autopar's MoEBlock:
    # tokens*E, traced precision; a Hugging Face stack: tokens*k fp32, as its routers return
    # them) and the top-k indices (a stack: tokens*k int64; none for the MoEBlock)
    moe_hidden_bytes: float = 0.0
    moe_weights_bytes: float = 0.0
    moe_index_bytes: float = 0.0
    vocab_logits_bytes: float = 0.0  # the head's logits per sample (the loss keeps them)
    # routed / traced expert work: top_k / num_experts for a dense-dispatch MoE (the graph runs
    # every expert on every token), 1 where it already routes (`as_run.routed_layer`)
    moe_routed_fraction: float = 1.0
    token_embedding: bool = False  # a token embedding: vocabulary-parallel under TP
    position_table: bool = False  # a learned position embedding (read by computed positions)
    vocab_split: bool = True  # False: `as_run.whole_vocabulary`'s, the layer whole on every tp rank
    # biases of row-parallel matmuls, counted in params_rep too: added after the all-reduce (or
    # the reduce-scatter, with SP), so whole, and their gradients whole on every tp rank
    params_row_bias: int = 0
    module_type: str = ""  # the class of the module the layer is (a block's, "Embedding", ...)
    # a block's parts Megatron-Core's selective recompute names (`module_regions`), by name
    module_regions: dict[str, RegionTable] = field(default_factory=dict)


@dataclass(frozen=True)
class ModelTables:
    layers: tuple[LayerTable, ...]
    seq_len: int
    hidden: int
    traced_float_bytes: int  # bytes per element of the traced model's floats
    model_flops_per_sample: float  # forward + backward, no recompute (the MFU numerator)
    num_params: int
    # with SP, where autopar's runtime splits the sequence at the first block and gathers it
    # after the last (`runtime.tensor_parallel.find_vocab_layers`: a Hugging Face model, a
    # position table, no final norm or no vocabulary pair) rather than at the embedding and
    # head (Megatron's ends)
    split_sequence_ends: bool = False


def build_tables(graph: ModelGraph) -> ModelTables:
    """Tables for every layer of ``graph`` (see the module docstring)."""
    nodes = graph.nodes
    seq_len = graph.input_shapes[0][-1] if graph.input_shapes else 1
    hidden = _hidden_size(graph)
    float_bytes = _traced_float_bytes(graph)
    derived = weight_copies(graph)
    kept = _whole_head_matmuls(graph)
    layers = tuple(_layer_table(layer, nodes, graph, derived, kept) for layer in graph.layers)
    return ModelTables(
        layers=layers,
        seq_len=int(seq_len),
        hidden=hidden,
        traced_float_bytes=float_bytes,
        model_flops_per_sample=graph.forward_flops + graph.backward_flops,
        num_params=graph.num_params,
        split_sequence_ends=not _megatron_ends(graph, layers),
    )


def _megatron_ends(graph: ModelGraph, layers: tuple[LayerTable, ...]) -> bool:
    """Whether autopar's runtime runs SP from the embedding to the head (its rule in
    `runtime.tensor_parallel.find_vocab_layers`): a token embedding and an LM head, a final
    norm after the blocks, no position table, not a Hugging Face model (which derives its
    positions and mask from the embedding output's shape)."""
    blocks = [i for i, t in enumerate(layers) if t.kind == "block"]
    if not blocks or graph.model_module.startswith("transformers."):
        return False
    pair = any(t.token_embedding for t in layers) and any(t.vocab_logits_bytes for t in layers)
    after = layers[blocks[-1] + 1 :]
    norm = any(t.params_rep and not t.params_tp and not t.vocab_logits_bytes for t in after)
    return pair and norm and not any(t.position_table for t in layers)


def _hidden_size(graph: ModelGraph) -> int:
    for layer in graph.layers:
        value = _block_input(layer, graph.nodes)
        if layer.kind == "block" and value is not None:
            return value.shapes[0][-1]
    return max(
        (n.shapes[0][-1] for n in graph.nodes.values() if n.shapes and n.shapes[0]), default=1
    )


def _block_input(layer: LayerInfo, nodes: dict[str, NodeInfo]) -> NodeInfo | None:
    """The activation flowing into a layer from an earlier one (the residual stream)."""
    inside = set(layer.nodes)
    for name in layer.nodes:
        for i in nodes[name].inputs:
            value = nodes[i]
            if i not in inside and value.requires_grad and value.kind == "call" and value.shapes:
                return value
    return None


def _traced_float_bytes(graph: ModelGraph) -> int:
    dtypes = [p.dtype for p in graph.parameters.values()]
    common = max(set(dtypes), key=dtypes.count) if dtypes else "float32"
    return DTYPE_BYTES.get(common, 4)


def _is_expert(node: NodeInfo) -> bool:
    return "experts" in node.module_path.split(".")


def _layer_table(
    layer: LayerInfo,
    nodes: dict[str, NodeInfo],
    graph: ModelGraph,
    derived: set[str],
    kept: frozenset[str],
) -> LayerTable:
    router = layer.moe.router if layer.moe else None
    region, ups = up_projection_region(layer, nodes)
    shard: dict[str, Shard] = {}
    matmuls, attention, allreduce = [], [], []
    matmul_nodes, attention_nodes, allreduce_nodes = [], [], {}  # which node made each entry
    column: set[str] = set()  # parameters of column-parallel matmuls (their biases split too)
    token_embedding = position_table = False
    memory: dict[Shard, list[float]] = {}
    for node, acts, classes, out in _shard_walk(layer, nodes, derived, shard, kept):
        if node.op_class == "matmul" and node.params:
            weight = sum(
                graph.parameters[p].num_bytes for p in node.params if p in graph.parameters
            )
            matmuls.append(
                MatmulOp(
                    flops=node.flops,
                    backward_flops=node.backward_flops,
                    weight_grad_flops=min(node.flops, node.backward_flops),
                    activation_bytes=max(0.0, node.bytes_read + node.bytes_written - weight),
                    weight_bytes=weight,
                    shard=(kind := _compute_shard(node, router, kept)),
                    groups=_expert_groups(layer, kind),
                    linear=graph.linears.get(node.module_path),
                    up_projection=node.name in ups,
                )
            )
            matmul_nodes.append(node.name)
            if out == "rep" and "tp" in classes:
                allreduce.append(float(node.bytes_written))
                allreduce_nodes[node.name] = float(node.bytes_written)
            elif out == "tp":
                column.update(node.params)
        elif node.op_class in ("matmul", "attention"):
            if node.op_class == "attention":
                kv = sum(value_bytes(nodes[i]) for i in acts[1:3])
                sent = sum(unrepeated_bytes(i, nodes) for i in acts[1:3])
                attention_nodes.append(node.name)
                attention.append(
                    AttentionOp(
                        node.flops,
                        node.backward_flops,
                        kv,
                        node.bytes_read + node.bytes_written,
                        sent,
                    )
                )
            else:
                # a matmul on gathered expert weights is the experts' weight matmul
                copies = [i for i in node.inputs if i in derived]
                gathered = sum(value_bytes(nodes[i]) for i in copies)
                matmul_nodes.append(node.name)
                matmuls.append(
                    MatmulOp(
                        node.flops,
                        node.backward_flops,
                        min(node.flops, node.backward_flops) if copies else 0.0,
                        max(0.0, node.bytes_read + node.bytes_written - gathered),
                        0.0,
                        "expert" if copies else out,
                    )
                )
        elif node.op == "aten.embedding.default" and node.params:
            if _indexed_by_tokens(node, nodes):
                allreduce.append(float(node.bytes_written))
                token_embedding = True
            else:
                position_table = True
            memory.setdefault("rep", [0.0, 0])
            memory["rep"][0] += node.bytes_written * 2
            memory["rep"][1] += 1
        elif node.op_class in ("elementwise", "reduction"):
            entry = memory.setdefault(out, [0.0, 0])
            entry[0] += node.bytes_read + node.bytes_written
            entry[1] += 1
    regions = block_regions(layer, nodes)
    value = _block_input(layer, nodes) if layer.moe else None
    none = set(layer.saved_values.get("none", ()))
    parts = {
        "-up_proj": frozenset(none & region),
        "-fused": frozenset(none & fused_kernel_surplus(layer, nodes)),
        "+fp32": frozenset(none & norm_upcasts(layer, nodes)),
    }
    return LayerTable(
        name=layer.name,
        class_id=layer.class_id,
        kind=layer.kind,
        matmuls=tuple(matmuls),
        attention=tuple(attention),
        memory_ops=tuple((k, v[0], int(v[1])) for k, v in memory.items()),
        tp_allreduce_bytes=tuple(allreduce),
        **_param_split(layer, graph, nodes, column, kept),
        activations=activation_split(
            layer,
            nodes,
            shard,
            derived,
            value.shapes[0][-1] if value and value.shapes else None,
            parts,
            regions,
        ),  # fmt: skip
        output_bytes=float(layer.output_bytes),
        moe_num_experts=layer.moe.num_experts if layer.moe else 0,
        moe_top_k=layer.moe.top_k if layer.moe else 0,
        moe_dispatch_bytes=_dispatch_bytes(layer, nodes) if layer.moe else 0.0,
        **_expert_call_bytes(layer, nodes),
        vocab_logits_bytes=_logits_bytes(layer, nodes),
        # a head TP keeps whole (a classifier, not a vocabulary): its logits are whole too
        vocab_split=_head_path(layer, nodes) not in kept,
        moe_routed_fraction=(
            layer.moe.top_k / layer.moe.num_experts
            if layer.moe and layer.moe.dense_dispatch
            else 1.0
        ),
        token_embedding=token_embedding,
        position_table=position_table,
        module_type=layer.module_type,
        module_regions=region_tables(
            regions, matmul_nodes, attention_nodes, allreduce_nodes, shard, nodes
        ),
    )


def _shard_walk(
    layer: LayerInfo,
    nodes: dict[str, NodeInfo],
    derived: set[str],
    shard: dict[str, Shard],
    kept: frozenset[str],
):
    """The layer's call nodes in graph order with the propagation's classes: (node, its
    activation inputs, their classes, its class); ``shard`` collects each node's class."""
    inside = set(layer.nodes)
    router = layer.moe.router if layer.moe else None
    for name in layer.nodes:
        node = nodes[name]
        if node.kind != "call" or name in derived:
            continue
        acts = [i for i in node.inputs if nodes[i].kind not in ("parameter", "buffer", "constant")]
        acts = [i for i in acts if i not in derived]
        classes = [shard.get(i, "rep") if i in inside else "rep" for i in acts]
        out = _propagate(node, classes, router, kept)
        shard[name] = out
        yield node, acts, classes, out


def tensor_parallel_roles(graph: ModelGraph) -> dict[str, str]:
    """Module path -> "col" | "row" for each weight matmul of the repeated blocks that the
    tables price split over tp: column-parallel where it reads the replicated stream, row-
    parallel where it reads a column-parallel one's sharded output (the module docstring's
    propagation). Routers, experts and MLA's down-projections are not split by TP and are
    left out. What autopar's runtime splits for a model whose projections it does not know
    by name (`autopar.runtime.tensor_parallel.tp_plan`'s ``roles``)."""
    derived = weight_copies(graph)
    roles: dict[str, str] = {}
    for layer in graph.layers:
        if layer.kind != "block":
            continue
        router = layer.moe.router if layer.moe else None
        for node, _, classes, _ in _shard_walk(layer, graph.nodes, derived, {}, frozenset()):
            split = _compute_shard(node, router, frozenset()) == "tp"
            if node.op_class != "matmul" or not node.params or not split:
                continue
            roles[node.module_path] = "row" if "tp" in classes else "col"
    return roles


# Projections tensor parallelism keeps whole: multi-head latent attention's down-projections
# (DeepSeek-V2/V3), "duplicated" in Megatron-Core's MLA and left whole by autopar's runtime
# (`autopar.runtime.tensor_parallel`), which splits the up-projections after them by head.
WHOLE_PROJECTIONS = frozenset({"q_a_proj", "kv_a_proj_with_mqa"})


def _whole(node: NodeInfo, router: str | None, kept: frozenset[str]) -> bool:
    """A weight matmul TP keeps replicated: the router, an MLA down-projection, a matmul
    outside the blocks other than the vocabulary head (`_whole_head_matmuls`)."""
    path = node.module_path
    named = path.rsplit(".", 1)[-1] in WHOLE_PROJECTIONS
    return bool(router and path == router) or named or path in kept


def _whole_head_matmuls(graph: ModelGraph) -> frozenset[str]:
    """Module paths of the weight matmuls outside the repeated blocks that TP leaves whole:
    all but the vocabulary head (a weight with as many rows as the token embedding), as
    autopar's runtime and Megatron do (BERT's MLM transform before its decoder, ViT's
    classifier). Empty for a model without blocks (a chain of linears splits in turn)."""
    blocks = [layer for layer in graph.layers if layer.kind == "block"]
    if not blocks:
        return frozenset()
    nodes = graph.nodes
    vocab = {
        graph.parameters[p].shape[0]
        for node in nodes.values()
        if node.op == "aten.embedding.default" and _indexed_by_tokens(node, nodes)
        for p in node.params
        if p in graph.parameters
    }
    out = set()
    for layer in graph.layers:
        if layer.kind == "block":
            continue
        for name in layer.nodes:
            node = nodes[name]
            if node.kind != "call" or node.op_class != "matmul" or not node.params:
                continue
            rows = {graph.parameters[p].shape[0] for p in node.params if p in graph.parameters
                    and len(graph.parameters[p].shape) == 2}  # fmt: skip
            if not rows & vocab:
                out.add(node.module_path)
    return frozenset(out)


def _propagate(
    node: NodeInfo, classes: list[Shard], router: str | None, kept: frozenset[str]
) -> Shard:
    if _is_expert(node):
        return "expert"
    if node.op_class == "matmul" and node.params and _whole(node, router, kept):
        return "rep"
    if router and node.module_path == router:
        return "rep"
    if node.op_class == "matmul" and node.params:
        return "rep" if "tp" in classes else "tp"
    if node.op == "aten.embedding.default":
        return "rep"
    return "tp" if "tp" in classes else ("expert" if "expert" in classes else "rep")


# ops that pass their input's values on in another shape: GPT-2 looks its tokens up after
# ``input_ids.view(-1, seq)``
_RESHAPES = frozenset(
    f"aten.{op}.default"
    for op in ("view", "reshape", "_unsafe_view", "clone", "contiguous", "alias", "flatten")
)


def _indexed_by_tokens(node: NodeInfo, nodes: dict[str, NodeInfo]) -> bool:
    """A token embedding (vocab-parallel under TP, Megatron) reads the model's input ids, or
    a reshape of them; a position embedding reads computed positions and stays replicated."""
    todo, seen = list(node.inputs), set()
    while todo:
        source = nodes[name] if (name := todo.pop()) in nodes else None
        if source is None or name in seen:
            continue
        seen.add(name)
        if source.kind == "input":
            return True
        if source.op in _RESHAPES:
            todo += source.inputs
    return False


def _compute_shard(node: NodeInfo, router: str | None, kept: frozenset[str]) -> Shard:
    """Where a weight matmul's FLOPs go: experts by EP, the router and the MLA
    down-projections replicated, the rest by TP."""
    if _is_expert(node):
        return "expert"
    return "rep" if _whole(node, router, kept) else "tp"


def _param_split(
    layer: LayerInfo,
    graph: ModelGraph,
    nodes: dict[str, NodeInfo],
    column: set[str],
    kept: frozenset[str],
) -> dict[str, int]:
    """Parameters owned by the layer, by how they shard: tp (matmul/embedding weights, and the
    biases of column-parallel matmuls, split with their output features as Megatron's
    ColumnParallelLinear and torch's ColwiseParallel do), expert, replicated (norms, the
    router, MLA's down-projections, biases of row-parallel layers: added after the all-reduce,
    so whole)."""
    tp, rep, expert, tensors, routing, row_bias = 0, 0, 0, 0, 0, 0
    sharded: set[str] = set()
    matmuls: dict[str, bool] = {}  # a sharded parameter: read by a weight matmul?
    router = layer.moe.router if layer.moe else None
    for name in layer.nodes:
        node = nodes[name]
        if node.kind == "call" and (
            (node.op_class == "matmul" and not _whole(node, router, kept))
            or (node.op == "aten.embedding.default" and _indexed_by_tokens(node, nodes))
        ):
            sharded.update(node.params)
            matmuls.update(dict.fromkeys(node.params, node.op_class == "matmul"))
    for p in graph.parameters.values():
        if p.layer != layer.name:
            continue
        tensors += 1
        if "experts" in p.name.split("."):
            expert += p.numel
        elif router and p.name.startswith(router + "."):
            rep += p.numel
            routing += p.numel
        elif p.name in sharded and (len(p.shape) >= 2 or p.name in column):
            tp += p.numel
        else:
            rep += p.numel
            row_bias += p.numel if p.name in sharded and matmuls.get(p.name) else 0
    return {
        "params_tp": tp,
        "params_rep": rep,
        "params_expert": expert,
        "num_param_tensors": tensors,
        "params_router": routing,
        "params_row_bias": row_bias,
    }


def _dispatch_bytes(layer: LayerInfo, nodes: dict[str, NodeInfo]) -> float:
    """tokens x top_k x hidden x element bytes: what one all-to-all moves, per sample."""
    assert layer.moe is not None
    value = _block_input(layer, nodes)
    return 0.0 if value is None else value_bytes(value) * layer.moe.top_k


def _expert_groups(layer: LayerInfo, shard: Shard) -> int:
    """`MatmulOp.groups` of a matmul of ``shard`` class in ``layer``: the experts, for an
    expert matmul of a graph that routes (transformers' stacks trace one grouped or batched
    matmul over all of them; autopar's dense-dispatch MoEBlock, one matmul per expert)."""
    moe = layer.moe
    return moe.num_experts if shard == "expert" and moe and not moe.dense_dispatch else 1


def _expert_call_bytes(layer: LayerInfo, nodes: dict[str, NodeInfo]) -> dict[str, float]:
    """The `LayerTable.moe_hidden_bytes` / `moe_weights_bytes` / `moe_index_bytes` of an MoE
    layer, per sample (their comment); nothing for another layer."""
    value = _block_input(layer, nodes) if layer.moe else None
    if layer.moe is None or value is None:
        return {}
    hidden = float(value_bytes(value))
    fb = DTYPE_BYTES.get(value.dtypes[0], 4)  # the hidden rows' element size
    tokens = hidden / (value.shapes[0][-1] * fb)
    moe = layer.moe
    if moe.dense_dispatch:  # autopar's MoEBlock: [T, E] weights in the model's dtype
        return {"moe_hidden_bytes": hidden, "moe_weights_bytes": tokens * moe.num_experts * fb}
    k = tokens * moe.top_k
    return {"moe_hidden_bytes": hidden, "moe_weights_bytes": 4 * k, "moe_index_bytes": 8 * k}


def _head(layer: LayerInfo, nodes: dict[str, NodeInfo]) -> NodeInfo | None:
    """The last layer's last matmul: the head whose logits the loss reads."""
    if layer.kind == "block" or layer.output_bytes:
        return None
    return next((nodes[n] for n in reversed(layer.nodes) if nodes[n].op_class == "matmul"), None)


def _head_path(layer: LayerInfo, nodes: dict[str, NodeInfo]) -> str:
    head = _head(layer, nodes)
    return head.module_path if head is not None else ""


def _logits_bytes(layer: LayerInfo, nodes: dict[str, NodeInfo]) -> float:
    head = _head(layer, nodes)
    return float(head.bytes_written) if head is not None else 0.0
