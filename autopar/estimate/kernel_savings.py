"""Saved values a stack's kernels do not keep where the eager trace does: multi-latent
attention's q, k and v under Megatron-Core's recompute of its up-projections, and the
intermediates of a decomposed RMSNorm and of a gated activation under fused kernels.

In: a layer of the trace and the graph's nodes. Out: sets of the layer's node names; the
tables price what they hold (`tables.LayerTable.activations`, "-up_proj" and "-fused") and the
memory model drops it where the stack says so (`CostOptions.recompute_up_projections`,
`CostOptions.fused_kernel_activations`).

Up-projections (recompute_modules "mla_up_proj"): Megatron-Core's MLA runs its up-projections,
the rotary embedding and the concatenations that make the attention's query, key and value
under a checkpoint that keeps its inputs (the normalised latents and the rotary part of the
down-projection) and frees its outputs once the attention has read them
(`CheckpointWithoutOutput`): the attention's saved q, k and v go, and so does every saved value
between the latents and them. Found by structure, not by module names: walking back from an
attention op's q, k and v through the ops of its attention module, a matmul whose input is made
inside that module (a latent after its norm) is an up-projection and closes the walk, its output
in the region; a matmul whose input comes from outside (the block's norm: a down-projection, or
a plain attention's q/k/v projection) closes it too, its output kept; values from outside the
module (the rotary tables) are not walked. Of the values walked, the region keeps those the
up-projections' outputs make (not the rotary tables' slices, nor the shared rotary key from the
down-projection, a single head: small, and kept here). A layer without an up-projection has no
region: the recompute is MLA's only.

Fused kernels (TransformerEngine's RMSNorm, Megatron-Core's bias-SwiGLU): an eager RMSNorm
(x.float(), x * rsqrt(mean(x^2) + eps), cast back, times the weight) saves the upcast input, the
normalised value and its output for the next matmul; the fused kernel saves its input, the
inverse root and the output, so the normalised value is the eager surplus: a saved value inside
a module that computes an rsqrt, read inside it, other than the rsqrt and a cast of the
module's input. An eager gated activation (silu(gate) * up) saves gate, up, silu(gate) and the
product; the fused kernel keeps gate and up (its input) and recomputes silu(gate) in its
backward, so the activation's output, where a multiply reads it, is the surplus.

Upcasts (`norm_upcasts`): the eager RMSNorm's upcast input is fp32 whatever the training
precision, so under bf16 autocast it saves 4 bytes an element where the trace of an fp32 model,
scaled to the precision, prices 2 (measured on an H100 and by the memory-peak test: the
runtime's peak held each norm's fp32 input, `StageMemory.activation_bytes`).
"""

from __future__ import annotations

from autopar.tracing.graph import LayerInfo, NodeInfo


def up_projection_region(
    layer: LayerInfo, nodes: dict[str, NodeInfo]
) -> tuple[frozenset[str], frozenset[str]]:
    """(the region's values, the up-projection matmuls) of ``layer`` (module docstring)."""
    region: set[str] = set()
    ups: set[str] = set()
    for name in layer.nodes:
        attention = nodes[name]
        if attention.op_class == "attention":
            _walk(layer.name, attention, nodes, region, ups)
    made = set(ups)  # what the up-projections' outputs make, in graph order
    for name in layer.nodes:
        if any(i in made for i in nodes[name].inputs):
            made.add(name)
    return frozenset(region & made), frozenset(ups)


def _inside(node: NodeInfo, scope: str) -> bool:
    return node.module_path == scope or node.module_path.startswith(scope + ".")


def _walk(
    layer: str, attention: NodeInfo, nodes: dict[str, NodeInfo], region: set[str], ups: set[str]
) -> None:
    """Back from ``attention``'s q, k and v to the matmuls that make them, within its module."""
    scope = attention.module_path
    stack, seen = list(attention.inputs[:3]), set()
    while stack:
        value = stack.pop()
        node = nodes.get(value)
        if value in seen or node is None or node.layer != layer or not _inside(node, scope):
            continue
        seen.add(value)
        if node.op_class == "matmul":
            latents = [i for i in node.inputs if i in nodes and nodes[i].kind == "call"]
            if any(_inside(nodes[i], scope) for i in latents):
                ups.add(value)
                region.add(value)
            continue
        region.add(value)
        stack.extend(node.inputs)


def fused_kernel_surplus(layer: LayerInfo, nodes: dict[str, NodeInfo]) -> frozenset[str]:
    """What ``layer``'s eager RMSNorms and gated activations save beyond fused kernels'
    (module docstring)."""
    members = [nodes[n] for n in layer.nodes]
    readers: dict[str, list[NodeInfo]] = {}
    for node in members:
        for i in node.inputs:
            readers.setdefault(i, []).append(node)
    norms = {n.module_path for n in members if n.op == "aten.rsqrt.default"}
    surplus = set()
    for node in members:
        read_by = readers.get(node.name, [])
        if node.module_path in norms:
            upcast = node.op == "aten.to.dtype" and all(
                i in nodes and nodes[i].module_path != node.module_path for i in node.inputs
            )
            inside = all(r.module_path == node.module_path for r in read_by)
            if read_by and inside and not upcast and node.op != "aten.rsqrt.default":
                surplus.add(node.name)
        elif node.op in _ACTIVATIONS and any(r.op == "aten.mul.Tensor" for r in read_by):
            surplus.add(node.name)
    return frozenset(surplus)


_ACTIVATIONS = {"aten.silu.default", "aten.gelu.default", "aten.relu.default"}


def norm_upcasts(layer: LayerInfo, nodes: dict[str, NodeInfo]) -> frozenset[str]:
    """The fp32 upcasts of ``layer``'s eager RMSNorms' inputs (`x.float()` in a module that
    computes an rsqrt, its input made outside it): saved for the backward in fp32 whatever
    the training precision, where the trace of an fp32 model shows them at its width."""
    members = [nodes[n] for n in layer.nodes]
    norms = {n.module_path for n in members if n.op == "aten.rsqrt.default"}
    return frozenset(
        n.name
        for n in members
        if n.module_path in norms
        and n.op == "aten.to.dtype"
        and n.dtypes[:1] == ("float32",)
        and all(i in nodes and nodes[i].module_path != n.module_path for i in n.inputs)
    )
