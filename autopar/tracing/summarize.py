"""Per-layer tables: FLOPs, parameters, activations by recompute policy, MoE facts.

Activation bytes of layer L per recompute policy (one sample):

    none       sum of the graph values L's ops save for backward, plus the ops' internal saved
               tensors (attention's log-sum-exp). A value saved by several layers is charged to
               the earliest of them, except values made outside every block and saved by more
               than one layer (rotary tables, masks), which are charged to their producer, so
               that equal blocks get equal numbers.
    selective  torch's selective activation checkpointing with the policy "save the outputs of
               matmul and attention ops that the backward needs, recompute the rest": those
               outputs, attention's internal saved tensors, and L's input.
    full       L's input only (the values L consumes from earlier layers that need grad).

While L's backward recomputes, the values that policy dropped are alive again: that is the
``recompute_transient_bytes`` (none minus the policy's bytes, at least 0).
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict

from torch import nn

from autopar.tracing.graph import LayerClass, LayerInfo, MoEInfo, ParamInfo
from autopar.tracing.layers import structural_hash
from autopar.tracing.nodes import RawNode

_ACTIVATION_KINDS = ("call", "input")


def summarize_layers(
    table: list[RawNode],
    layer_of: dict[str, str],
    blocks: set[str],
    model: nn.Module,
) -> tuple[tuple[LayerInfo, ...], tuple[LayerClass, ...], dict[str, ParamInfo]]:
    nodes = {r.name: r for r in table}
    members: dict[str, list[str]] = defaultdict(list)
    for raw in table:
        members[layer_of[raw.name]].append(raw.name)
    order = list(dict.fromkeys(layer_of[r.name] for r in table if r.kind == "call"))
    order += [name for name in members if name not in order]
    params = _param_table(table, layer_of, model)
    charged = _charge_saved_values(table, layer_of, blocks, nodes)
    saved_anywhere = set().union(*charged.values()) if charged else set()
    modules = dict(model.named_modules())
    hashes = {n: structural_hash(members[n], nodes) for n in order if n in blocks}
    class_ids = _class_ids(order, blocks, hashes, modules)
    layers = []
    for index, name in enumerate(order):
        layer_nodes = [nodes[n] for n in members[name]]
        owned = [p for p in params.values() if p.layer == name]
        moe = _moe_info(name, layer_nodes, params, nodes, modules)
        saved, internal = _saved_sets(
            name, layer_nodes, charged[name], nodes, layer_of, saved_anywhere
        )
        act = {k: sum(nodes[v].nbytes for v in saved[k]) + internal[k] for k in saved}
        flops = sum(r.flops for r in layer_nodes)
        backward = sum(r.backward_flops for r in layer_nodes)
        moe_block = modules.get(moe.router.rsplit(".", 1)[0]) if moe else None
        if moe is not None and getattr(moe_block, "dense_dispatch", False):
            flops, backward = _routed_flops(layer_nodes, moe, flops, backward)
            moe = dataclasses.replace(moe, dense_dispatch=True)
        layers.append(
            LayerInfo(
                name=name,
                index=index,
                kind="block" if name in blocks else "other",
                module_type=type(modules[name]).__name__ if name in modules else "ops",
                class_id=class_ids[name],
                nodes=tuple(members[name]),
                forward_flops=flops,
                backward_flops=backward,
                num_params=sum(p.numel for p in owned),
                param_bytes=sum(p.num_bytes for p in owned),
                activation_bytes=act,
                recompute_transient_bytes={k: max(0.0, act["none"] - v) for k, v in act.items()},
                saved_values=saved,
                saved_internal_bytes=internal,
                input_bytes=_boundary_bytes(layer_nodes, nodes, layer_of, name, incoming=True),
                output_bytes=_boundary_bytes(layer_nodes, nodes, layer_of, name, incoming=False),
                moe=moe,
            )
        )
    classes = _classes(layers, hashes)
    return tuple(layers), classes, params


def _param_table(
    table: list[RawNode], layer_of: dict[str, str], model: nn.Module
) -> dict[str, ParamInfo]:
    owner: dict[str, str] = {}
    for raw in table:
        if raw.kind == "call":
            for p in raw.params:
                owner.setdefault(p, layer_of[raw.name])
    out = {}
    for name, p in model.named_parameters():
        out[name] = ParamInfo(
            name=name,
            shape=tuple(p.shape),
            dtype=str(p.dtype).removeprefix("torch."),
            numel=p.numel(),
            num_bytes=p.numel() * p.element_size(),
            layer=owner.get(name, "<unused>"),
        )
    return out


def _charge_saved_values(
    table: list[RawNode], layer_of: dict[str, str], blocks: set[str], nodes: dict[str, RawNode]
) -> dict[str, set[str]]:
    savers: dict[str, list[str]] = defaultdict(list)
    for raw in table:
        if raw.kind != "call":
            continue
        values = list(raw.saved_inputs) + ([raw.name] if raw.saved_self else [])
        for v in values:
            if nodes[v].kind in _ACTIVATION_KINDS:
                savers[v].append(layer_of[raw.name])
    charged: dict[str, set[str]] = defaultdict(set)
    for value, layers in savers.items():
        producer = layer_of[value]
        shared = producer not in blocks and len(set(layers)) > 1
        charged[producer if shared else layers[0]].add(value)
    return charged


def _saved_sets(
    name: str,
    layer_nodes: list[RawNode],
    charged: set[str],
    nodes: dict[str, RawNode],
    layer_of: dict[str, str],
    saved_anywhere: set[str],
) -> tuple[dict[str, tuple[str, ...]], dict[str, float]]:
    """Per policy: the graph values kept for backward, and the ops' internal saved bytes."""
    inputs = {
        i
        for r in layer_nodes
        if r.kind == "call"
        for i in r.inputs
        if layer_of[i] != name and nodes[i].kind in _ACTIVATION_KINDS and nodes[i].requires_grad
    }
    # matmul outputs that the backward needs (saved by some op), and attention outputs (the
    # kernel's backward reads its output; `ops._SAVED_RULES` leaves it to the output projection)
    kept = {
        r.name
        for r in layer_nodes
        if r.requires_grad
        and (r.op_class == "attention" or (r.op_class == "matmul" and r.name in saved_anywhere))
    }
    values = {"none": charged, "selective": kept | inputs, "full": inputs}
    internal = {
        "none": sum(r.saved_internal_bytes for r in layer_nodes),
        "selective": sum(r.saved_internal_bytes for r in layer_nodes if r.op_class == "attention"),
        "full": 0,
    }
    order = {r.name: i for i, r in enumerate(nodes.values())}
    return (
        {k: tuple(sorted(v, key=order.__getitem__)) for k, v in values.items()},
        {k: float(v) for k, v in internal.items()},
    )


def _boundary_bytes(
    layer_nodes: list[RawNode],
    nodes: dict[str, RawNode],
    layer_of: dict[str, str],
    name: str,
    *,
    incoming: bool,
) -> int:
    if incoming:
        values = {
            i
            for r in layer_nodes
            for i in r.inputs
            if layer_of[i] != name and nodes[i].kind in _ACTIVATION_KINDS
        }
        return sum(nodes[v].nbytes for v in values)
    inside = {r.name for r in layer_nodes}
    out = {
        i
        for r in nodes.values()
        if layer_of[r.name] != name
        for i in r.inputs
        if i in inside and nodes[i].kind == "call"
    }
    return sum(nodes[v].nbytes for v in out)


def _class_ids(
    order: list[str], blocks: set[str], hashes: dict[str, str], modules: dict[str, nn.Module]
) -> dict[str, str]:
    ids: dict[str, str] = {}
    by_hash: dict[str, str] = {}
    per_type: dict[str, int] = defaultdict(int)
    for name in order:
        if name not in blocks:
            ids[name] = name
            continue
        h = hashes[name]
        if h not in by_hash:
            type_name = type(modules[name]).__name__
            per_type[type_name] += 1
            suffix = "" if per_type[type_name] == 1 else f"#{per_type[type_name]}"
            by_hash[h] = f"{type_name}{suffix}"
        ids[name] = by_hash[h]
    return ids


def _classes(layers: list[LayerInfo], hashes: dict[str, str]) -> tuple[LayerClass, ...]:
    grouped: dict[str, list[LayerInfo]] = defaultdict(list)
    for layer in layers:
        grouped[layer.class_id].append(layer)
    return tuple(
        LayerClass(cid, hashes.get(members[0].name, ""), tuple(m.name for m in members))
        for cid, members in grouped.items()
    )


def _moe_info(
    name: str,
    layer_nodes: list[RawNode],
    params: dict[str, ParamInfo],
    nodes: dict[str, RawNode],
    modules: dict[str, nn.Module],
) -> MoEInfo | None:
    # The last top-k picks the experts (DeepSeek-V3 first picks expert groups with top-k's).
    topk = next((r for r in reversed(layer_nodes) if r.op.startswith("aten.topk")), None)
    if topk is None:
        return None
    num_experts = nodes[topk.inputs[0]].shapes[0][-1]
    expert_params = [
        p for p in params.values() if p.layer == name and "experts" in p.name.split(".")
    ]
    if not expert_params or num_experts < 2:
        return None
    router = _router_of(topk, nodes)
    numel = sum(p.numel for p in expert_params)
    return MoEInfo(
        num_experts=num_experts,
        top_k=int(topk.extra.get("k", 0)),
        expert_params=numel // num_experts,
        expert_param_bytes=sum(p.num_bytes for p in expert_params) // num_experts,
        router=router,
    )


def _router_of(topk: RawNode, nodes: dict[str, RawNode]) -> str:
    """Module path of the matmul (with a parameter) that feeds the top-k."""
    frontier = [topk.inputs[0]]
    seen: set[str] = set()
    while frontier:
        name = frontier.pop()
        if name in seen:
            continue
        seen.add(name)
        raw = nodes[name]
        if raw.op_class == "matmul" and raw.params:
            return raw.module_stack[-1][0] if raw.module_stack else raw.params[0]
        frontier.extend(i for i in raw.inputs if nodes[i].kind == "call")
    return ""


def _routed_flops(
    layer_nodes: list[RawNode], moe: MoEInfo, flops: float, backward: float
) -> tuple[float, float]:
    # A dense-dispatch MoE (autopar.models) runs every expert on every token; a routed one runs
    # each token on top_k experts. Count the routed FLOPs, which is what the planner prices.
    scale = moe.top_k / moe.num_experts
    expert = [
        r for r in layer_nodes if r.module_stack and "experts" in r.module_stack[-1][0].split(".")
    ]
    dense_f = sum(r.flops for r in expert)
    dense_b = sum(r.backward_flops for r in expert)
    return flops - dense_f * (1 - scale), backward - dense_b * (1 - scale)
