"""ModelGraph: what the tracer hands to the cost model and the solver.

Plain frozen data: per-node and per-layer tables keyed by name, the layer classes (repeated
blocks with equal structural hash), parameters, and the ops DTensor has no sharding rule for.
All FLOPs and bytes are for ONE sample (the example inputs' batch of 1); the planner scales them
by the micro-batch size. Backward FLOPs and saved activations come from running each op's
autograd on meta tensors, not from formulas, so they follow whatever the model really does.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

OpClass = Literal["matmul", "attention", "elementwise", "reduction", "view", "other"]
Recompute = Literal["none", "selective", "full"]
NodeKind = Literal["parameter", "buffer", "input", "constant", "call", "output"]


@dataclass(frozen=True)
class NodeInfo:
    """One node of the exported aten graph."""

    name: str
    op: str  # "aten.mm.default", or the node kind for placeholders and the output
    kind: NodeKind
    op_class: OpClass
    inputs: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]  # one per tensor output
    dtypes: tuple[str, ...]
    requires_grad: bool
    flops: float  # forward
    backward_flops: float
    bytes_read: int
    bytes_written: int
    params: tuple[str, ...]  # FQNs of the parameters it reads (also through views)
    module_path: str
    layer: str

    @property
    def output_bytes(self) -> int:
        return self.bytes_written


@dataclass(frozen=True)
class MoEInfo:
    """A mixture-of-experts layer, as expert parallelism needs it."""

    num_experts: int
    top_k: int
    expert_params: int  # parameters of ONE expert
    expert_param_bytes: int
    router: str  # module path of the router
    # True: the graph runs every expert on every token (`autopar.models.moe.MoEBlock`); its
    # expert nodes hold num_experts / top_k times the routed FLOPs and activations
    dense_dispatch: bool = False


@dataclass(frozen=True)
class LayerInfo:
    """A pipeline-partitionable unit: a repeated block, or a module outside the blocks."""

    name: str
    index: int
    kind: Literal["block", "other"]
    module_type: str
    class_id: str
    nodes: tuple[str, ...]
    forward_flops: float
    backward_flops: float
    num_params: int
    param_bytes: int
    # Activation bytes this layer keeps from its forward for its backward, per recompute policy.
    activation_bytes: Mapping[str, float]
    # Extra bytes alive while this layer is recomputed in the backward (selective/full).
    recompute_transient_bytes: Mapping[str, float]
    input_bytes: int  # activations flowing in from earlier layers
    output_bytes: int  # activations flowing out to later layers
    moe: MoEInfo | None = None
    # What makes up activation_bytes: per policy, the graph values kept (node names) and the
    # bytes ops save internally (attention's log-sum-exp).
    saved_values: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    saved_internal_bytes: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class LayerClass:
    """Layers with equal structure: the solver plans one representative for all members."""

    id: str
    structural_hash: str
    members: tuple[str, ...]

    @property
    def representative(self) -> str:
        return self.members[0]


@dataclass(frozen=True)
class ParamInfo:
    name: str
    shape: tuple[int, ...]
    dtype: str
    numel: int
    num_bytes: int
    layer: str  # the first layer that reads it (tied weights count once)


@dataclass(frozen=True)
class ModelGraph:
    model_type: str
    input_shapes: tuple[tuple[int, ...], ...]
    nodes: Mapping[str, NodeInfo]
    layers: tuple[LayerInfo, ...]
    classes: tuple[LayerClass, ...]
    parameters: Mapping[str, ParamInfo]
    # Nodes whose op DTensor has no sharding rule for: planned replicated, listed in the plan.
    ops_without_sharding_rule: tuple[tuple[str, str], ...]
    graph_module: Any = field(default=None, repr=False, compare=False)
    model_module: str = ""  # the model class's module ("transformers.models.llama...")
    # every nn.Linear of the model (subclasses too) by module path: (in_features,
    # out_features, has a bias), what a low-precision recipe's coverage asks
    # (`Recipe.torchao_converts`); transformers' Conv1D and the like are not in it
    linears: Mapping[str, tuple[int, int, bool]] = field(default_factory=dict)
    # constants torch.export lifted whose values it does not know: made by the model's code
    # from meta tensors (Falcon's); a pipeline cut from the graph cannot rebuild them
    meta_constants: tuple[str, ...] = ()

    @property
    def num_params(self) -> int:
        return sum(p.numel for p in self.parameters.values())

    @property
    def param_bytes(self) -> int:
        return sum(p.num_bytes for p in self.parameters.values())

    @property
    def forward_flops(self) -> float:
        return sum(layer.forward_flops for layer in self.layers)

    @property
    def backward_flops(self) -> float:
        return sum(layer.backward_flops for layer in self.layers)

    def layer(self, name: str) -> LayerInfo:
        for layer in self.layers:
            if layer.name == name:
                return layer
        raise KeyError(f"no layer {name!r}; layers: {', '.join(x.name for x in self.layers)}")

    def class_of(self, layer_name: str) -> LayerClass:
        return next(c for c in self.classes if layer_name in c.members)

    def as_text(self) -> str:
        from autopar.tracing.text import model_graph_text

        return model_graph_text(self)
