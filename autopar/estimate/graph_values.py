"""What a traced value is, read from the graph alone: views, a parameter's copies, a tensor
before a repeat.

In: a `ModelGraph`'s nodes. Out: the names of values that are a parameter's rather than
activations (`weight_copies`), and the bytes of a value before the views and copies that
repeat it (`unrepeated_bytes`). `autopar.estimate.tables` reads both while it builds the
per-layer tables.
"""

from __future__ import annotations

from autopar.estimate.saved_split import value_bytes
from autopar.tracing.graph import ModelGraph, NodeInfo

# ops whose output is a view of their input's memory: a view of a parameter holds no bytes
VIEWS = frozenset(
    f"aten.{op}"
    for op in (
        "transpose.int", "t.default", "permute.default", "view.default", "_unsafe_view.default",
        "reshape.default", "expand.default", "unsqueeze.default", "squeeze.dim", "alias.default",
        "slice.Tensor", "select.int", "detach.default",
    )
)  # fmt: skip


def weight_copies(graph: ModelGraph) -> set[str]:
    """Values that are a parameter's, not activations: computed from parameters alone with a
    parameter gathered per token on the way (transformers' batched_mm experts, a model's own
    choice, index an [E, f, h] weight by each token's expert), or views of a parameter (the
    transposed expert stack its grouped_mm experts pass to the grouped GEMM). Real MoE kernels
    read each expert's weights once and store no per-token copy, and a view stores nothing, so
    these values are neither activations nor memory traffic here, and a matmul that reads one
    is the experts' weight matmul."""
    copies: set[str] = set()
    weights: set[str] = set()
    views: set[str] = set()  # a parameter, or a chain of views of one
    for node in graph.nodes.values():
        if node.kind == "parameter":
            weights.add(node.name)
            views.add(node.name)
        elif node.kind == "call" and node.inputs:
            if node.op in VIEWS and node.inputs[0] in views:
                views.add(node.name)
                copies.add(node.name)
            floats = [i for i in node.inputs if is_float(graph.nodes[i])]
            if floats and all(i in weights for i in floats):
                weights.add(node.name)
                gathered = node.op.startswith("aten.index") or any(i in copies for i in floats)
                if gathered:
                    copies.add(node.name)
    return copies


# ops that copy or reshape a tensor without computing on it: how a GQA repeat of the key and
# value heads is traced (Hugging Face's `repeat_kv`: a slice, expand and reshape, a copy)
REPEATS = VIEWS | {
    f"aten.{op}"
    for op in (
        "clone.default", "contiguous.default", "repeat.default", "repeat_interleave.self_int",
    )
}  # fmt: skip


def unrepeated_bytes(name: str, nodes: dict[str, NodeInfo]) -> float:
    """The bytes of an attention input before any repeat: the smallest tensor on its chain of
    views and copies back to the op that computed it (a GQA model's K and V before they are
    repeated to the query heads; the input itself where nothing repeats it)."""
    least = value_bytes(nodes[name])
    node = nodes[name]
    while node.kind == "call" and node.op in REPEATS and node.inputs and node.inputs[0] in nodes:
        node = nodes[node.inputs[0]]
        least = min(least, value_bytes(node))
    return least


def is_float(node: NodeInfo) -> bool:
    return any(d.startswith(("float", "bfloat")) for d in node.dtypes)
