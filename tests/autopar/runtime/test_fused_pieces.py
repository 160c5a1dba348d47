"""A fused projection's local output under tensor parallelism (`autopar.runtime.fused_pieces`):
cut at the whole output's offsets, each rank's `Pieces` gives its share of each piece.

One process: the whole output of q|k|v (three pieces of 8) and each of two ranks' share of
every piece; the cuts GPT-2 (split), Phi-3 (slices, chunk) and others use, on each rank's
`Pieces`, equal the whole output's cuts, each of them the rank's share of its pieces;
gradients flow through; an offset inside a piece is refused with the offset."""

from __future__ import annotations

import pytest
import torch

from autopar.runtime.fused_pieces import Pieces

PIECE, WAYS = 8, 2


def _share(whole: torch.Tensor, rank: int) -> torch.Tensor:
    return torch.cat([p.chunk(WAYS, -1)[rank] for p in whole.split(PIECE, -1)], -1)


CUTS = {
    "split": lambda x: x.split(PIECE, dim=-1),
    "split dim=2": lambda x: x.split(PIECE, dim=2),
    "torch.split sizes": lambda x: torch.split(x, [PIECE, 2 * PIECE], dim=-1),
    "chunk": lambda x: x.chunk(3, dim=-1),
    "slices": lambda x: (x[..., :PIECE], x[..., PIECE : 2 * PIECE], x[..., 2 * PIECE :]),
    "negative slice": lambda x: (x[:, :, -PIECE:],),
    "tensor_split indices": lambda x: x.tensor_split([PIECE, 2 * PIECE], dim=2),
    "narrow": lambda x: (x.narrow(-1, PIECE, PIECE),),
}


@pytest.mark.parametrize("name", list(CUTS))
def test_each_rank_cuts_its_share_of_every_piece(name):
    whole = torch.randn(2, 3, 3 * PIECE)
    cut = CUTS[name]
    for rank in range(WAYS):
        got = cut(Pieces.wrap(_share(whole, rank), WAYS, PIECE))
        want = [_share(t, rank) for t in cut(whole)]  # of a cut of two pieces: of each
        assert all(type(t) is torch.Tensor for t in got)  # plain tensors from here on
        assert [t.shape for t in got] == [t.shape for t in want]
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_gradients_reach_the_share_and_offsets_inside_a_piece_are_refused():
    local = torch.randn(2, 3, 3 * PIECE // WAYS, requires_grad=True)
    q, k, v = Pieces.wrap(local, WAYS, PIECE).split(PIECE, dim=-1)
    (2 * k).sum().backward()
    assert local.grad[..., 4:8].eq(2).all() and local.grad[..., :4].eq(0).all()
    assert type(Pieces.wrap(local, WAYS, PIECE) * 2) is torch.Tensor
    with pytest.raises(ValueError, match=r"is cut at 4, inside a piece"):
        Pieces.wrap(local.detach(), WAYS, PIECE)[..., :4]
