"""IntraOptions.precision: a layer traced in fp32 priced as trained in bf16."""

from __future__ import annotations

import pytest

import autopar
from autopar.models import zoo
from autopar.solve.intra import IntraOptions, solve_layer


@pytest.fixture(scope="module")
def gpt():
    model = zoo.build("gpt-tiny", device="meta", num_layers=2)
    return autopar.trace(model, zoo.example_inputs("gpt-tiny", model))


def test_bf16_halves_the_bytes_and_prices_compute_at_bf16(gpt):
    cluster = autopar.Cluster.from_profile("dgx_h100")
    layer = next(x.name for x in gpt.layers if x.kind == "block")
    as_traced = solve_layer(gpt, layer, cluster, 1)
    bf16 = solve_layer(gpt, layer, cluster, 1, options=IntraOptions(precision="bf16"))
    assert bf16.parameter_bytes == pytest.approx(as_traced.parameter_bytes / 2, abs=64)
    assert bf16.compute_s < as_traced.compute_s  # H100's bf16 peak is above its fp32 one
    with pytest.raises(ValueError, match="precision"):
        IntraOptions(precision="fp8")  # type: ignore[arg-type]
