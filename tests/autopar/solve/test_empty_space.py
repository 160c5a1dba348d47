"""A search space with no config in it: the refusal says what was tried and why nothing fits.

(It crashed before, `min() arg is an empty sequence`, inside the explanation.)
"""

from __future__ import annotations

import pytest

import autopar
from autopar.models import zoo
from autopar.solve import InfeasibleError


@pytest.fixture(scope="module")
def gpt():
    model = zoo.build("gpt-tiny", device="meta")  # 4 heads, 2 layers, seq 32
    return model, autopar.trace(model, zoo.example_inputs("gpt-tiny", model))


def _plan(gpt, profile: str, batch: int | None, **size):
    model, graph = gpt
    cluster = autopar.Cluster.from_profile(profile, **size)
    return autopar.parallelize(model, cluster, global_batch_size=batch, graph=graph)


def test_three_devices_and_a_power_of_two_batch(gpt):
    with pytest.raises(InfeasibleError) as err:
        _plan(gpt, "local_cpu", 1024, num_devices=3)
    text = str(err.value)
    assert "no parallel config exists for 3 devices (3 per node)" in text
    assert "global batch of 1024 sequences" in text and "leave 3 data-parallel ranks" in text
    assert "a multiple of 3" in text
    # the default batch is a multiple of the world's odd factor: three devices plan
    assert _plan(gpt, "local_cpu", None, num_devices=3).global_batch_size % 3 == 0


def test_sixteen_nodes_and_a_batch_of_sixteen():
    """llama-tiny: tp at most its 2 key/value heads, pp at most its 2 layers, so 128 devices
    leave at least 32 data-parallel ranks for a batch of 16."""
    model = zoo.build("llama-tiny", device="meta")
    graph = autopar.trace(model, zoo.example_inputs("llama-tiny", model))
    with pytest.raises(InfeasibleError) as err:
        _plan((model, graph), "dgx_h100", 16, num_nodes=16)
    text = str(err.value)
    assert "no parallel config exists for 128 devices (8 per node)" in text
    assert "global batch of 16 sequences" in text and "a multiple of 32" in text


def test_a_prime_number_of_devices(gpt):
    """7 devices: tp and pp cannot be 7 (4 heads, 2 layers), so all 7 are data-parallel: a
    batch of 8 has no config, a batch of 7 has one."""
    model, graph = gpt
    cluster = autopar.Cluster.from_profile("local_cpu", num_devices=7)
    with pytest.raises(InfeasibleError, match="leave 7 data-parallel ranks"):
        autopar.parallelize(model, cluster, global_batch_size=8, graph=graph)
    assert autopar.parallelize(model, cluster, global_batch_size=7, graph=graph).config.dp == 7
