"""Tracer on small models: FLOPs, bytes, layers and errors against hand-computed values."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from autopar.tracing import TraceError, trace


class MLP(nn.Module):
    def __init__(self, sizes: list[int]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(sizes, sizes[1:], strict=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


def test_mlp_flops_bytes_and_layers():
    sizes = [32, 64, 64, 16]
    model = MLP(sizes)
    graph = trace(model, torch.randn(1, 32))
    pairs = list(zip(sizes, sizes[1:], strict=False))
    forward = sum(2 * a * b for a, b in pairs)
    # Backward: weight grads everywhere, input grads everywhere but the first layer (its input
    # is data, which needs no grad).
    backward = sum(2 * a * b for a, b in pairs) + sum(2 * a * b for a, b in pairs[1:])
    assert graph.forward_flops == forward
    assert graph.backward_flops == backward
    assert graph.num_params == sum(p.numel() for p in model.parameters())
    assert [layer.name for layer in graph.layers] == ["layers.0", "layers.1", "layers.2"]
    # layers.1 and layers.2 differ in shape: three classes
    assert len(graph.classes) == 3
    first = graph.layer("layers.0")
    addmm = next(graph.nodes[n] for n in first.nodes if graph.nodes[n].op_class == "matmul")
    assert addmm.bytes_written == 64 * 4
    assert addmm.bytes_read == (32 + 64 * 32 + 64) * 4
    assert addmm.params == ("layers.0.weight", "layers.0.bias")
    assert first.param_bytes == (32 * 64 + 64) * 4


def test_equal_blocks_form_one_class_and_meta_models_trace():
    with torch.device("meta"):
        model = MLP([64] * 6)
    graph = trace(model, torch.empty(1, 64, device="meta"))
    # layer 0 reads the data (no input gradient): a class of its own; the other four share one
    first, rest = graph.classes
    assert first.members == ("layers.0",)
    assert rest.members == tuple(f"layers.{i}" for i in range(1, 5))
    assert "x4" in graph.as_text()


def test_saved_activations_follow_autograd():
    # relu saves its output, linear saves its input: layer i keeps its input (for the weight
    # grad) and its relu output (the next layer's input is the same tensor, charged once).
    model = MLP([128, 256, 256])
    graph = trace(model, torch.randn(1, 128))
    act = {layer.name: layer.activation_bytes["none"] for layer in graph.layers}
    # layers.0: relu output (256 floats); its input x needs no grad but is saved by addmm for
    # the weight grad: 128 floats.
    assert act["layers.0"] == (128 + 256) * 4
    assert act["layers.1"] == 256 * 4
    assert graph.layer("layers.1").activation_bytes["full"] == 256 * 4


class Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(4, 4), Gate())

    def forward(self, x):
        return self.inner(x)


class Gate(nn.Module):
    def forward(self, x):
        if x.sum() > 0:  # data-dependent control flow: not capturable
            return x * 2
        return x


def test_untraceable_op_names_the_op_and_module(capfd):
    """The error names the op and the module; torch's print of the partial graph (every aten
    op up to the failure, hundreds of lines for a real model) is left out of stderr."""
    with pytest.raises(TraceError) as err:
        trace(Branchy(), torch.randn(1, 4))
    message = str(err.value)
    assert "inner.1" in message
    assert "aten._local_scalar_dense" in message or "aten.gt" in message or "aten.sum" in message
    assert "def forward(" not in capfd.readouterr().err


@torch.library.custom_op("autopar_test::double", mutates_args=())
def _double(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@_double.register_fake
def _(x):
    return torch.empty_like(x)


class WithCustomOp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return _double(self.fc(x))


def test_op_without_sharding_rule_is_recorded_not_fatal():
    graph = trace(WithCustomOp(), torch.randn(1, 8))
    assert [op for _, op in graph.ops_without_sharding_rule] == ["autopar_test.double.default"]
    assert "autopar_test.double.default" in graph.as_text()
    # ops DTensor knows (addmm through linear's decomposition) are not listed
    assert all(
        "addmm" not in op and "linear" not in op for _, op in graph.ops_without_sharding_rule
    )
