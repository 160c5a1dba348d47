"""torchft's Manager for one rank of a replica group: what DiLoCo and fault-tolerant groups share.

In: the group's index, the lighthouse, this rank's rank and world in its group, the timeout,
the fewest groups a step commits with, and the state a healthy peer hands a rejoining group
(`LocalShards`: this rank's parameter shards and their optimizer state). Out: a
`torchft.Manager` on a fault-tolerant gloo group, meeting its group through the group's own
TCPStore (MASTER_ADDR / MASTER_PORT, as torchrun sets them).
Synchronous quorum (`use_async_quorum=False`): DiLoCo requires it, and a rejoining group is
healed before its forward rather than during it. Timeouts ordered as torchft needs them
(`ft_timeouts`): a collective with a dead group fails first, then a quorum that waits for it,
and a group's first connection last.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
from torch import nn

from autopar.runtime.collectives import local_shard


def ft_timeouts(timeout_s: float) -> tuple[float, float, float]:
    """(collective, quorum, connect) seconds for a collective timeout of ``timeout_s``:
    each at least twice the one before, the quorum 60 s and the connect 120 s at least."""
    quorum = max(60.0, 2 * timeout_s)
    return timeout_s, quorum, max(120.0, 2 * quorum)


def group_manager(
    replica_id: int,
    lighthouse: str,
    rank: int,
    world_size: int,
    timeout_s: float,
    min_replicas: int,
    state: tuple[Callable[[Any], None], Callable[[], Any]] | None = None,
    init_sync: bool = True,
) -> Any:
    """A torchft Manager for this rank (module docstring); ``state``: (load, save);
    ``init_sync``: whether the first quorum copies the first group's state to the others (off
    where every group starts from the same seed or checkpoint and must keep its own)."""
    # imported here: torchft is an optional dependency of the replica-group paths only
    from torchft import Manager, ProcessGroupGloo

    collective, quorum, connect = ft_timeouts(timeout_s)
    timeout = timedelta(seconds=collective)
    load, save = state if state is not None else (None, None)
    return Manager(
        pg=ProcessGroupGloo(timeout=timeout),
        min_replica_size=min_replicas,
        load_state_dict=load,
        state_dict=save,
        use_async_quorum=False,
        replica_id=f"group{replica_id}",
        store_addr=os.environ["MASTER_ADDR"],
        store_port=int(os.environ["MASTER_PORT"]),
        rank=rank,
        world_size=world_size,
        lighthouse_addr=lighthouse,
        timeout=timeout,
        quorum_timeout=timedelta(seconds=quorum),
        connect_timeout=timedelta(seconds=connect),
        init_sync=init_sync,
    )


class LocalShards:
    """The state a healthy peer hands a rejoining group's same rank: this rank's local shards
    of the model's trainable parameters and of their optimizer state (the same rank of every
    group holds the same shapes)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = optimizer

    def save(self) -> dict[str, Any]:
        with torch.no_grad():
            params = [local_shard(p).detach().clone() for p in self.params]
            moments = [
                {k: local_shard(v).detach().clone() for k, v in self.optimizer.state[p].items()}
                for p in self.params
            ]
        return {"params": params, "optimizer": moments}

    def load(self, state: dict[str, Any]) -> None:
        with torch.no_grad():
            for p, value in zip(self.params, state["params"], strict=True):
                local_shard(p).copy_(value)
            for p, saved in zip(self.params, state["optimizer"], strict=True):
                if not saved:
                    continue
                mine = self.optimizer.state[p]
                for key, value in saved.items():
                    if key not in mine:  # no step taken here yet: a moment shaped as p
                        # (its placements kept), or a scalar as the peer's (AdamW's step)
                        mine[key] = torch.zeros_like(p) if value.dim() else value.clone()
                    local_shard(mine[key]).copy_(value)
