"""Pipeline chunks cut from the traced graph (`autopar.runtime.traced_stages`), in one process:
the chunks run in turn equal the model, values a later chunk reads are carried through the
ones between, a weight shared beyond the first and last chunk is refused by name, and a
model without one list of blocks is told why. (Training on gloo ranks against one process:
test_any_model.py.)"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from autopar.runtime.stages import even_layout
from autopar.runtime.task import _call_any
from autopar.runtime.traced_stages import traced_blocks, traced_chunks, why_no_block_list


class Block(nn.Module):
    def __init__(self, dim: int, shared: nn.Parameter | None = None) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, dim)
        self.shared = shared  # one parameter in every block: a weight all chunks read

    def forward(self, h: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.fc(h)) + bias
        return h if self.shared is None else h * self.shared


class Net(nn.Module):
    """Embedding -> 6 blocks, each reading a bias made once before the first -> head."""

    def __init__(self, share: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        shared = nn.Parameter(torch.ones(8)) if share else None
        self.embed = nn.Embedding(16, 8)
        self.blocks = nn.ModuleList(Block(8, shared) for _ in range(6))
        self.head = nn.Linear(8, 16)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        bias = h.mean(dim=1, keepdim=True)  # read by every block: carried across the cuts
        for block in self.blocks:
            h = block(h, bias)
        return self.head(h)


def _chunks(share: bool, pp: int, ids: torch.Tensor) -> list[nn.Module]:
    """Each pp rank's chunk, cut as that rank cuts it: from a model of its own."""
    layout = even_layout(6, pp)
    return [traced_chunks(Net(share), _call_any, (ids,), layout, k)[0][0] for k in range(pp)]


def test_chunks_in_turn_equal_the_model_and_carry_what_later_chunks_read():
    ids = torch.randint(0, 16, (2, 5))
    want = Net()(ids)
    chunks = _chunks(False, 3, ids)
    out: tuple | torch.Tensor = (ids,)
    for chunk in chunks:
        out = chunk(*out) if isinstance(out, tuple) else chunk(out)
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    assert chunks[1].route.give[0][0] == "in"  # the bias, handed through the middle chunk
    assert [p for p, _ in chunks[1].named_blocks()] == ["blocks.2", "blocks.3"]
    assert {n for n, _ in chunks[2].named_parameters()} >= {"blocks.5.fc.weight", "head.bias"}


def test_a_weight_shared_by_every_chunk_is_refused_by_name():
    ids = torch.randint(0, 16, (2, 5))
    with pytest.raises(ValueError, match=r"blocks\.\d\.shared on chunk 0.* on chunk 1"):
        _chunks(True, 3, ids)


def test_a_model_without_one_list_of_blocks_is_told_why():
    class TwoLists(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.encoder = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))
            self.decoder = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))

    assert traced_blocks(Net()) == ("blocks", 6)
    assert traced_blocks(TwoLists()) is None
    assert why_no_block_list(TwoLists()) == (
        "its repeated blocks are in 2 lists (encoder (2), decoder (3)), not one"
    )
    assert why_no_block_list(nn.Sequential(nn.Linear(4, 4))) == (
        "it has no nn.ModuleList of repeated blocks"
    )


def test_an_embedding_slot_cuts_from_the_trace_and_a_loss_slot_is_refused():
    """pipeline_slots on a model without a ModelParts entry: the embedding's chunk of its own
    (no block) is cut before block 0; the head's would start at a module the trace does not
    name, so that layout is refused by name."""

    class Net3(Net):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.blocks = nn.ModuleList(Block(8) for _ in range(3))

    ids = torch.randint(0, 16, (2, 5))
    want = Net3()(ids)
    layout = even_layout(3, pp=2, virtual_stages=2, slots=("embedding",))
    assert layout.bounds[0] == (0, 0)
    chunks = {}
    for rank in range(2):
        for chunk in traced_chunks(Net3(), _call_any, (ids,), layout, rank)[0]:
            chunks[chunk.chunk] = chunk
    out: tuple | torch.Tensor = (ids,)
    for k in range(4):
        out = chunks[k](*out) if isinstance(out, tuple) else chunks[k](out)
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    loss = even_layout(3, pp=2, virtual_stages=2, slots=("loss",))
    with pytest.raises(ValueError, match="a loss slot .* needs a ModelParts entry .* Net3"):
        traced_chunks(Net3(), _call_any, (ids,), loss, 0)
