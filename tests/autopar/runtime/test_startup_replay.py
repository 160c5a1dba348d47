"""The recorded build and its replay (`autopar.runtime.startup.record`, `.replay`, `.rng`,
`.regions`), in one process: what makes every rank's shard hold the whole tensor's values.

- Any elements of a parameter replay to the values the whole tensor holds there, for every
  parameter of zoo and Hugging Face models (a random subset of coordinates, against the whole).
- The replayed initialization is the factory's: each parameter's mean and spread match a
  build of the same model on the CPU with torch's generator (constants exactly: norms, biases,
  rotary tables, Gemma's embedding scale); trunc_normal_ (which torch skips on meta) is
  recorded and its bounds hold; a write through a view (an embedding's padding row zeroed)
  lands on that row only.
- The counter-based draws are uniform and normal (moments), and depend on the key.
- `region_of` agrees with `distribute_tensor` on what a rank's local tensor holds, for
  Shard, _StridedShard and both over one dimension (on a fake 2 x 2 mesh of rank 3).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from autopar.models import hf, zoo
from autopar.runtime.startup import rng
from autopar.runtime.startup.record import InitRecordError, record_build
from autopar.runtime.startup.regions import HandSlice, region_of
from autopar.runtime.startup.replay import Evaluator

MODELS = {
    "gpt-tiny": lambda: zoo.build("gpt-tiny", device="meta"),
    "moe-tiny": lambda: zoo.build("moe-tiny", device="meta"),
    "llama-tiny-hf": lambda: hf.build("llama-tiny-hf", device="meta"),
    "mixtral-tiny-hf": lambda: hf.build("mixtral-tiny-hf", device="meta"),
    "gpt2-tiny-hf": lambda: hf.build("gpt2-tiny-hf", device="meta"),
}
REAL = {
    "gpt-tiny": lambda: zoo.build("gpt-tiny"),
    "moe-tiny": lambda: zoo.build("moe-tiny"),
    "llama-tiny-hf": lambda: hf.build("llama-tiny-hf"),
    "mixtral-tiny-hf": lambda: hf.build("mixtral-tiny-hf"),
    "gpt2-tiny-hf": lambda: hf.build("gpt2-tiny-hf"),
}


@pytest.mark.parametrize("name", list(MODELS))
def test_any_elements_replay_to_the_whole_tensors_values(name):
    model, record = record_build(MODELS[name])
    gen = torch.Generator().manual_seed(0)
    for pname, p in [*model.named_parameters(), *model.named_buffers()]:
        whole = Evaluator().full(record.source(pname))
        assert whole.shape == p.shape and whole.dtype == p.dtype, pname
        if not p.dim():
            continue
        coords = tuple(torch.randint(0, s, (50,), generator=gen) for s in p.shape)
        part = Evaluator().values(record.source(pname), coords)
        assert torch.equal(part, whole[coords]), pname


@pytest.mark.parametrize("name", list(MODELS))
def test_the_replayed_init_is_the_factorys(name):
    model, record = record_build(MODELS[name])
    real = REAL[name]()
    for pname, want in [*real.named_parameters(), *real.named_buffers()]:
        got = Evaluator().full(record.source(pname))
        if want.numel() < 64 or not want.is_floating_point() or want.float().std() == 0:
            assert torch.equal(got, want), pname  # constants: exactly
            continue
        ratio = got.float().std() / want.float().std()
        assert 0.8 < ratio < 1.25, (pname, ratio)
        assert abs(got.float().mean() - want.float().mean()) < 0.2 * want.float().std(), pname


def test_the_same_seed_gives_the_same_weights_and_another_seed_others():
    def weights(seed: int) -> torch.Tensor:
        _, record = record_build(MODELS["llama-tiny-hf"], seed=seed)
        return Evaluator().full(record.source("model.layers.0.mlp.up_proj.weight"))

    assert torch.equal(weights(0), weights(0))
    # hf.build seeds its own build (seed=0): the record's seed does not override it
    _, record = record_build(lambda: hf.build("llama-tiny-hf", device="meta", seed=1))
    other = Evaluator().full(record.source("model.layers.0.mlp.up_proj.weight"))
    assert not torch.equal(weights(0), other)


class _Init(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(40, 8, padding_idx=3)
        self.pos = nn.Parameter(torch.empty(64, 16))
        nn.init.trunc_normal_(self.pos, std=0.5, a=-0.6, b=0.6)
        self.scale = nn.Buffer(torch.tensor(2.5), persistent=False)


def test_truncated_normal_views_and_tensor_constants_are_recorded():
    model, record = record_build(_Init)
    pos = Evaluator().full(record.source("pos"))
    assert pos.abs().max() <= 0.6 and pos.std() > 0.2  # recorded, within its bounds
    emb = Evaluator().full(record.source("emb.weight"))
    assert torch.equal(emb[3], torch.zeros(8)) and bool((emb[2] != 0).all())
    rows = Evaluator().values(record.source("emb.weight"), (torch.tensor([3, 3, 4]),
                                                            torch.tensor([0, 7, 7])))  # fmt: skip
    assert torch.equal(rows, torch.stack([emb[3, 0], emb[3, 7], emb[4, 7]]))
    assert Evaluator().full(record.source("scale")).item() == 2.5


def test_a_tensor_made_before_the_build_is_named():
    made = torch.empty(3, device="meta")

    class Uses(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(made * 2)

    with pytest.raises(InitRecordError, match="made before the recorded build"):
        record_build(Uses)


def test_the_counter_draws_are_uniform_normal_and_keyed():
    pos = torch.arange(200_000)
    u = rng.uniform(rng.mix_key(0, 1), pos)
    assert u.min() > 0 and u.max() < 1 and abs(u.mean() - 0.5) < 0.005
    z = rng.normal(rng.mix_key(0, 1), pos)
    assert abs(z.mean()) < 0.01 and abs(z.std() - 1) < 0.01
    assert abs(((z - z.mean()) ** 3).mean()) < 0.03 and abs((z**4).mean() - 3) < 0.05
    assert not torch.equal(u, rng.uniform(rng.mix_key(0, 2), pos))
    assert torch.equal(u[1000:1010], rng.uniform(rng.mix_key(0, 1), pos[1000:1010]))


@pytest.fixture()
def fake_mesh():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=3, world_size=4)
    try:
        yield init_device_mesh("cpu", (2, 2), mesh_dim_names=("fsdp", "tp"))
    finally:
        dist.destroy_process_group()


def test_a_region_is_what_distribute_tensor_keeps(fake_mesh):
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

    whole = torch.arange(12 * 10, dtype=torch.float32).reshape(12, 10)
    for placements in (
        [Shard(0), Shard(1)],
        [Replicate(), Shard(0)],
        [Shard(1), _StridedShard(0, split_factor=3)],
        [Shard(0), Shard(0)],
    ):
        dt = distribute_tensor(whole, fake_mesh, placements, src_data_rank=None)  # no comms
        region = region_of(dt, whole.shape)
        grid = torch.meshgrid(*region.indices, indexing="ij")
        assert torch.equal(dt.to_local(), whole[grid]), placements


def test_hand_slices_cut_pieces_over_ranks():
    whole = torch.arange(2 * 8 * 3).reshape(2, 8, 3)
    # an expert stack of 2: ep rank 1 of 2 keeps expert 1; etp rank 0 of 2 keeps the first
    # half of each of the 2 pieces (gate, up) of dim 1
    cuts = (HandSlice(0, 1, 1, 2), HandSlice(1, 2, 0, 2))
    local = whole[1:2][:, [0, 1, 4, 5]]
    region = region_of(local, whole.shape, cuts)
    assert torch.equal(whole[torch.meshgrid(*region.indices, indexing="ij")], local)
    with pytest.raises(ValueError, match="placements and slices give"):
        region_of(whole[:1], whole.shape, cuts[1:])
