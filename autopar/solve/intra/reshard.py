"""Price of moving a tensor from one placement to another on the tensor-parallel group.

In: source and target placement, the tensor's full (unsharded) bytes, t and the group (how the
t ranks lie on the cluster's levels, `Cluster.comm_group`). Out: seconds and the collective.
Each case is DTensor's `redistribute` on a 1-D mesh, priced by `cost_models.comm`
(`collective_time`, message sizes in the nccl-tests convention that module states):

    src \\ dst     R                   S(j)                     P
    R             0                   0 (local slice)          0 (local: keep on one rank)
    S(i)          all-gather(B)       i == j: 0                all-gather(B), then local
                                      i != j: all-to-all(B/t)
    P             all-reduce(B)       reduce-scatter(B)        same reduce op: 0,
                                                               else all-reduce(B)

B = full bytes of the tensor; an all-to-all's message is each rank's send buffer, B/t.
"""

from __future__ import annotations

from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from cost_models.comm import Group, collective_time


def reshard_collective(
    src: Placement, dst: Placement, full_bytes: float, t: int
) -> tuple[str, float] | None:
    """(collective, message bytes) that turns `src` into `dst`, or None when it is local."""
    if src == dst or t == 1 or isinstance(src, Replicate):
        return None
    if isinstance(src, Shard):
        if isinstance(dst, Shard):
            return "all_to_all", full_bytes / t
        return "all_gather", full_bytes  # to R, or to P through R
    if isinstance(src, Partial):
        if isinstance(dst, Shard):
            return "reduce_scatter", full_bytes
        return "all_reduce", full_bytes  # to R, or to another reduce op
    raise ValueError(f"unknown placement {src!r}")


def reshard_time_s(
    src: Placement, dst: Placement, full_bytes: float, t: int, group: Group
) -> float:
    """Seconds to redistribute a tensor of `full_bytes` from `src` to `dst` on `group`."""
    step = reshard_collective(src, dst, full_bytes, t)
    if step is None:
        return 0.0
    collective, message_bytes = step
    return collective_time(collective, message_bytes, group).time_s
