"""Autograd-correct collectives for context and expert parallelism, on torch.distributed.

In: tensors and a process group. Out: tensors whose backward is the adjoint collective, so a
loss on every rank differentiates to the gradients of the sum of the ranks' losses:

    all_gather_seq(x, group, dim)      forward all-gather along ``dim`` (rank order);
                                       backward reduce-scatter (each rank's slice of the sum)
    reduce_scatter_seq(x, group, dim)  its adjoint: reduce-scatter forward, all-gather backward
    gather_rows(x, group, dim=0)       the all-gather without autograd (routing indices)
    ring_shift(x, group)               forward: send to rank+1, receive from rank-1 (ring);
                                       backward: the gradient goes the other way round
    all_to_all(x, out_splits, in_splits, group)
                                       forward all_to_all_single with split sizes (rows);
                                       backward the same with the splits swapped
    ring_attention(q, k, v, group, pos_q, pos_blocks, is_causal, scale, window=None)
                                       online-softmax attention over K/V blocks passed
                                       round the ring (see `autopar.runtime.context_parallel`)
    attended(pos_q, pos_k, window)     [queries, keys] True where causal attention, within
                                       a sliding window, attends
    TokenExchange(e_P, num_experts, group)
                                       expert parallelism's token traffic: rows of (token,
                                       expert) pairs sorted by expert go to the experts'
                                       owners (`dispatch`) and come back (`combine`)
    all_reduce_flat(tensors, group, divide_by=1, bucket_bytes=25 MiB, reduce=None)
                                       in place, no autograd: one flat buffer per dtype,
                                       all-reduced in chunks (`cost_models.comm.flat_chunks`;
                                       gradient syncs of data, context, sequence and expert
                                       parallelism)

Why by hand: torch.distributed.nn.functional has all_gather/all_to_all but no sequence-dim
gather with a reduce-scatter backward and no ring step, and torch's ring attention
(`torch.distributed.tensor.experimental.context_parallel`) has no CPU rule in torch 2.13.
Every rank must call these in the same order (they are collectives), forward and backward;
the graphs are the same on every rank, so autograd's order is too.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch.autograd import Function
from torch.distributed.tensor import DTensor

from cost_models.comm import DDP_BUCKET_BYTES, flat_chunks


def _front(x: torch.Tensor, dim: int) -> torch.Tensor:
    return x.movedim(dim, 0).contiguous()


def gather_rows(x: torch.Tensor, group: dist.ProcessGroup, dim: int = 0) -> torch.Tensor:
    """Every rank's ``x`` concatenated along ``dim`` in rank order; no autograd."""
    front = _front(x, dim)
    out = front.new_empty((dist.get_world_size(group) * front.shape[0], *front.shape[1:]))
    dist.all_gather_single(out, front, group=group)
    return out.movedim(0, dim)


def _scatter_rows(x: torch.Tensor, group: dist.ProcessGroup, dim: int) -> torch.Tensor:
    """This rank's slice along ``dim`` of the sum of every rank's ``x``; no autograd."""
    front = _front(x, dim)
    out = front.new_empty((front.shape[0] // dist.get_world_size(group), *front.shape[1:]))
    dist.reduce_scatter_single(out, front, group=group)
    return out.movedim(0, dim)


class _GatherSeq(Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        return gather_rows(x, group, dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _scatter_rows(grad, ctx.group, ctx.dim), None, None


class _ScatterSeq(Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        return _scatter_rows(x, group, dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return gather_rows(grad, ctx.group, ctx.dim), None, None


def all_gather_seq(x: torch.Tensor, group: dist.ProcessGroup, dim: int) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim`` in rank order (backward: reduce-scatter)."""
    return _GatherSeq.apply(x, group, dim)


def reduce_scatter_seq(x: torch.Tensor, group: dist.ProcessGroup, dim: int) -> torch.Tensor:
    """This rank's slice along ``dim`` of the sum of every rank's ``x`` (backward:
    all-gather): `all_gather_seq`'s adjoint."""
    return _ScatterSeq.apply(x, group, dim)


def _shift(x: torch.Tensor, group: dist.ProcessGroup, step: int) -> torch.Tensor:
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    to = dist.get_global_rank(group, (rank + step) % size)
    source = dist.get_global_rank(group, (rank - step) % size)
    out = torch.empty_like(x)
    ops = [
        dist.P2POp(dist.isend, x.contiguous(), to, group),
        dist.P2POp(dist.irecv, out, source, group),
    ]
    for request in dist.batch_isend_irecv(ops):
        request.wait()
    return out


class _RingShift(Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return _shift(x, group, 1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _shift(grad, ctx.group, -1), None


def ring_shift(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """The tensor of rank-1 (mod size); backward sends the gradient back to its owner."""
    return _RingShift.apply(x, group)


class _AllToAll(Function):
    @staticmethod
    def forward(
        ctx,
        x: torch.Tensor,
        out_splits: list[int],
        in_splits: list[int],
        group: dist.ProcessGroup,
    ) -> torch.Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return back, None, None, None


def all_to_all(
    x: torch.Tensor,
    out_splits: Sequence[int],
    in_splits: Sequence[int],
    group: dist.ProcessGroup,
) -> torch.Tensor:
    """Rows ``x[sum(in_splits[:r]) : ...]`` go to rank r; rank r's rows arrive in slot r."""
    return _AllToAll.apply(x, list(out_splits), list(in_splits), group)


class RoutedRows:
    """Rows this rank's expert-parallel layers sent to experts and received for its own,
    summed since the last `take` (every layer, micro-batch and recomputed forward). All ranks
    send equally many (each routes its own tokens' top k), so received / sent is this rank's
    load over the mean: the imbalance `CostOptions.moe_imbalance` prices for the busiest."""

    def __init__(self) -> None:
        self.sent = self.received = 0

    def take(self) -> tuple[int, int]:
        out, self.sent, self.received = (self.sent, self.received), 0, 0
        return out


# this process's tally, read by the training loop once a step (`trainer.StepResult`)
ROUTED_ROWS = RoutedRows()


class TokenExchange:
    """The all-to-alls of one expert-parallel layer. ``e_P``: the expert of each (token, expert)
    pair this rank routes, sorted; expert e lives on ep rank e // (num_experts / ep). The
    per-expert counts are exchanged first, so each owner knows how many rows every rank sends.
    ``local_R``: the local expert of each received row (rows arrive by source rank, then local
    expert)."""

    def __init__(self, e_P: torch.Tensor, num_experts: int, group: dist.ProcessGroup) -> None:
        ep = dist.get_world_size(group)
        per_rank = num_experts // ep
        counts_E = torch.bincount(e_P, minlength=num_experts)
        recv_counts = torch.empty_like(counts_E)  # [source rank, local expert] flattened
        dist.all_to_all_single(recv_counts, counts_E, group=group)
        recv_EL = recv_counts.view(ep, per_rank)
        self.group = group
        self.send_splits = counts_E.view(ep, per_rank).sum(1).tolist()
        self.recv_splits = recv_EL.sum(1).tolist()
        ROUTED_ROWS.sent += sum(self.send_splits)
        ROUTED_ROWS.received += sum(self.recv_splits)
        local = torch.arange(per_rank, device=e_P.device).repeat(ep)
        self.local_R = local.repeat_interleave(recv_EL.flatten())

    def dispatch(self, rows_PH: torch.Tensor) -> torch.Tensor:
        """This rank's pair rows to their experts' owners; the rows this rank's experts get."""
        return all_to_all(rows_PH, self.recv_splits, self.send_splits, self.group)

    def combine(self, out_RH: torch.Tensor) -> torch.Tensor:
        """The experts' outputs back to the ranks whose pairs they were, in pair order."""
        return all_to_all(out_RH, self.send_splits, self.recv_splits, self.group)


def _repeat_heads(x_BKSD: torch.Tensor, num_heads: int) -> torch.Tensor:
    n = num_heads // x_BKSD.shape[1]
    return x_BKSD if n == 1 else x_BKSD.repeat_interleave(n, dim=1)


def attended(pos_q: torch.Tensor, pos_k: torch.Tensor, window: int | None) -> torch.Tensor:
    """[queries, keys] True where a query attends to a key: causal, and with ``window`` only
    to keys less than ``window`` positions back (transformers' sliding-window masks)."""
    allowed = pos_k[None, :] <= pos_q[:, None]
    if window is not None:
        allowed &= pos_k[None, :] > pos_q[:, None] - window
    return allowed


def ring_attention(
    q_BNSD: torch.Tensor,
    k_BKSD: torch.Tensor,
    v_BKSD: torch.Tensor,
    group: dist.ProcessGroup,
    pos_q: torch.Tensor,
    pos_blocks: Sequence[torch.Tensor],
    is_causal: bool,
    scale: float | None,
    window: int | None = None,
) -> torch.Tensor:
    """softmax(q K^T * scale + mask) V with K/V passed round the ring, merged by online
    softmax (running max m, denominator l, numerator a; out = a / l). ``window``: causal
    within a sliding window (`attended`); the own block still holds the
    diagonal.

    ``pos_blocks[r]`` are rank r's key positions. Step t holds rank (rank - t)'s block; step
    0 is the own block, which under the causal mask holds every query's diagonal, so the
    running max is finite from the start. m is a stabiliser the result does not depend on,
    so it carries no gradient. Every step computes (a fully masked block adds zeros) so the
    backward's ring shifts are the same on every rank.
    """
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    scale = q_BNSD.shape[-1] ** -0.5 if scale is None else scale
    kv = torch.stack([k_BKSD, v_BKSD])
    m = l_sum = acc = None
    for step in range(size):
        if step:
            kv = ring_shift(kv, group)
        k, v = (_repeat_heads(t, q_BNSD.shape[1]) for t in kv.unbind(0))
        scores = torch.matmul(q_BNSD, k.transpose(-2, -1)) * scale
        if is_causal:
            allowed = attended(pos_q, pos_blocks[(rank - step) % size], window)
            scores = scores.masked_fill(~allowed, float("-inf"))
        block_max = scores.detach().amax(dim=-1, keepdim=True)
        m_new = block_max if m is None else torch.maximum(m, block_max)
        p = torch.exp(scores - m_new)
        l_b, a_b = p.sum(dim=-1, keepdim=True), torch.matmul(p, v)
        if m is None:
            l_sum, acc = l_b, a_b
        else:
            rescale = torch.exp(m - m_new)
            l_sum, acc = l_sum * rescale + l_b, acc * rescale + a_b
        m = m_new
    return acc / l_sum


def all_reduce_flat(
    tensors: Sequence[torch.Tensor],
    group: dist.ProcessGroup | None,
    divide_by: int = 1,
    bucket_bytes: int = DDP_BUCKET_BYTES,
    reduce: Callable[[torch.Tensor], object] | None = None,
) -> None:
    """Sum ``tensors`` over ``group`` in place (None: no collective), then divide by
    ``divide_by`` (gloo has no AVG); ``reduce``: reduce each chunk in place by this instead
    (torchft's fault-tolerant all-reduce over replica groups). Per dtype the tensors are one
    flat buffer, summed in chunks of at most ``bucket_bytes`` (`cost_models.comm.flat_chunks`:
    all full but the last, the sizes the plan predicts): each chunk is copied out of the
    tensors, all-reduced and copied back, so the sync holds one chunk beside the gradients,
    as DDP holds its buckets (one flat copy of them all held their whole size again). Why by
    hand: torch's coalesced all-reduce is deprecated and its bucketing lives inside DDP."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for same in by_dtype.values():
        # flat views to read and write (a strided tensor: a contiguous copy, written back)
        flats = [t.view(-1) if t.is_contiguous() else t.contiguous().view(-1) for t in same]
        size = same[0].element_size()
        start = 0
        for nbytes in flat_chunks(sum(f.numel() for f in flats) * size, bucket_bytes):
            end = start + int(nbytes) // size
            pieces = list(_pieces(flats, start, end))
            chunk = torch.cat([f[a:b] for f, a, b in pieces])
            if reduce is not None:
                reduce(chunk)
            elif group is not None:
                dist.all_reduce(chunk, group=group)
            if divide_by != 1:
                chunk.div_(divide_by)
            offset = 0
            for f, a, b in pieces:
                f[a:b].copy_(chunk[offset : offset + b - a])
                offset += b - a
            del chunk  # freed before the next is made: one chunk held at a time
            start = end
        for t, f in zip(same, flats, strict=True):
            if not t.is_contiguous():
                t.copy_(f.view_as(t))


def _pieces(flats: list[torch.Tensor], start: int, end: int):
    """(flat tensor, first, last) of each tensor's elements in ``[start, end)`` of their
    concatenation."""
    offset = 0
    for f in flats:
        a, b = max(start, offset), min(end, offset + f.numel())
        if a < b:
            yield f, a - offset, b - offset
        offset += f.numel()


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of ``t`` (``t`` itself where it is not a DTensor)."""
    return t.to_local() if isinstance(t, DTensor) else t
