"""Layers: group the node table into pipeline-partitionable layers and classes of equal layers.

Blocks are the children of a ModuleList/Sequential that holds two or more modules of one type
(decoder layers; the outermost such lists, so experts stay inside their layer). A node belongs
to the outermost block in its module stack; a node outside every block belongs to the outermost
module on its stack that is not an ancestor of a block (embedding, rotary, final norm, head); an
op run by an ancestor itself joins the latest layer it reads from, or, reading none (mask
building from input ids in LlamaModel.forward), forms a prologue or an epilogue layer. Blocks
with equal Weisfeiler-Lehman hashes of their labelled subgraphs (networkx) form one class; every
other layer is a class of its own.
"""

from __future__ import annotations

import warnings
from collections import Counter, defaultdict

import networkx as nx
from torch import nn

from autopar.tracing.nodes import RawNode


def linear_of(module: nn.Module) -> tuple[int, int, bool] | None:
    """``module`` as a low-precision recipe's coverage sees it: (in_features, out_features,
    has a bias) for an ``nn.Linear`` (subclasses too), None for any other module (transformers'
    Conv1D among them); `config.precision.Recipe.torchao_converts` takes it."""
    if not isinstance(module, nn.Linear):
        return None
    return (module.in_features, module.out_features, module.bias is not None)


def find_blocks(model: nn.Module) -> set[str]:
    """Module paths of the repeated blocks (outermost lists only)."""
    blocks: set[str] = set()
    for path, module in model.named_modules():
        if not isinstance(module, nn.ModuleList | nn.Sequential):
            continue
        children = list(module.named_children())
        counts = Counter(type(child) for _, child in children)
        for name, child in children:
            if counts[type(child)] >= 2:
                blocks.add(f"{path}.{name}" if path else name)
    return {b for b in blocks if not any(b.startswith(o + ".") for o in blocks)}


def ancestors(blocks: set[str]) -> set[str]:
    """The module paths that hold the blocks ("" the model): a layer outside the blocks is
    a module whose parent is one of them."""
    chain = {""}
    for block in blocks:
        parts = block.split(".")
        chain.update(".".join(parts[:i]) for i in range(1, len(parts)))
    return chain


def assign_layers(table: list[RawNode], blocks: set[str]) -> dict[str, str]:
    """Layer name of every node (graph order); placeholders join their first consumer's layer."""
    chain = ancestors(blocks)
    layer_of: dict[str, str] = {}
    rank: dict[str, int] = {}  # layers in order of first appearance
    seen_block = False
    for raw in table:
        if raw.kind != "call":
            continue
        paths = [path for path, _ in raw.module_stack]
        layer = next((p for p in paths if p in blocks), None)
        seen_block = seen_block or layer is not None
        if layer is None:
            layer = next((p for p in paths if p not in chain), None)
        if layer is None:
            # Ops run by a block's ancestor itself (torch.relu between blocks, the output
            # alias) join the latest layer they read from; with none, a prologue/epilogue.
            fed_by = [layer_of[i] for i in raw.inputs if i in layer_of]
            if fed_by:
                layer = max(fed_by, key=rank.__getitem__)
            else:
                owner = paths[-1] if paths and paths[-1] else "<root>"
                layer = f"{owner} ({'epilogue' if seen_block else 'prologue'})"
        rank.setdefault(layer, len(rank))
        layer_of[raw.name] = layer
    consumers: dict[str, list[str]] = defaultdict(list)
    for raw in table:
        for i in raw.inputs:
            consumers[i].append(raw.name)
    last = next((layer_of[r.name] for r in reversed(table) if r.name in layer_of), "<root>")
    for raw in table:
        if raw.kind == "output":
            layer_of[raw.name] = last
        elif raw.name not in layer_of:
            first = next((c for c in consumers[raw.name] if c in layer_of), None)
            layer_of[raw.name] = layer_of[first] if first else last
    return layer_of


def structural_hash(names: list[str], nodes: dict[str, RawNode]) -> str:
    """WL hash of a layer's subgraph; labels are op, shapes, dtypes (and parameter shapes)."""
    inside = set(names)
    graph = nx.DiGraph()
    for name in names:
        raw = nodes[name]
        if raw.kind != "call" or raw.op == "aten.alias.default":
            continue  # alias: export's marker for a graph output, not part of the structure
        graph.add_node(name, label=f"{raw.op}|{raw.shapes}|{raw.dtypes}")
        for position, i in enumerate(raw.inputs):
            while i in inside and nodes[i].op == "aten.alias.default" and nodes[i].inputs:
                i = nodes[i].inputs[0]  # an alias is its input (skipped above)
            if i not in inside or nodes[i].kind != "call":
                src = f"ext:{i}"
                graph.add_node(
                    src,
                    label=(
                        f"in|{nodes[i].kind == 'parameter'}|{nodes[i].requires_grad}|"
                        f"{nodes[i].shapes}|{nodes[i].dtypes}"
                    ),
                )
            else:
                src = i
            graph.add_edge(src, name, label=str(position))
    with warnings.catch_warnings():
        # networkx 3.5 changed directed-graph hashes once and warns about it on every call;
        # hashes are only compared within one trace.
        warnings.simplefilter("ignore", UserWarning)
        return nx.weisfeiler_lehman_graph_hash(graph, node_attr="label", edge_attr="label")
