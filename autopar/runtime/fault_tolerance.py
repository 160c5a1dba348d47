"""Fault-tolerant replica groups with torchft: groups that fail alone and rejoin from a peer.

In: this rank's model (parallelised inside its group: FSDP2 over the group's own process
group makes this HSDP with the replicate axis fault tolerant), its optimizer, and an `FTGroup`
(which group, how many, the lighthouse, the fewest groups a step may commit with). Out: a
`FaultTolerantGroups` the training loop drives each step:

    steps(n)            the steps to run: each begins with torchft's quorum (the groups alive
                        now); a group that (re)joins behind the others is healed there -- its
                        model and optimizer state copied from a healthy peer's same rank
                        (`state_dict` / `load_state_dict`, local shards) -- and its step set
                        to theirs, so the loop goes on from the peers' step, not from 0; the
                        group's ranks then check that they stand at one step (`group_step`)
    sync_gradients(m)   each gradient's local shard averaged over the groups in the quorum
                        (torchft's fault-tolerant all-reduce): a failure there is recorded,
                        not raised
    should_commit()     whether this step's optimizer step may be taken: every rank of the
                        group alike, false where an all-reduce failed or too few groups took
                        part (the step is dropped everywhere it failed)
    digest()            a hash of this rank's parameter shards, which the program prints at
                        the end: the same rank of every group must print the same
    costs()             torchft's own time a step, medians over the steps: the quorum, the
                        gradient all-reduce over the groups, the commit (what
                        `autopar.estimate.algorithms.ft_step_cost` prices)

A failed group costs the others the step in flight and then only its share of the throughput
while it restarts (its own torchrun --max-restarts) and heals; no global restart. What holds
for the weights: after a step every group that committed holds the same parameters (each
applied the same averaged gradient to the same state); steps a group missed are averaged over
the groups that were there, so the weights differ from an uninterrupted run's -- the
algorithm does not promise those (torchft's, and `autopar.estimate.algorithms` prices only the
lost time).

Written on torchft's Manager (quorum, healing transport, fault-tolerant gloo/NCCL groups); what
is ours is the state a group hands its peers and the loop's hooks.
"""

from __future__ import annotations

import hashlib
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from autopar.runtime.collectives import all_reduce_flat, local_shard
from autopar.runtime.replica_groups import LocalShards, group_manager


@dataclass(frozen=True)
class FTGroup:
    """This rank's replica group in a fault-tolerant run (module docstring)."""

    replica_id: int
    num_replicas: int
    lighthouse: str  # "http://host:port"
    min_replicas: int = 1  # the fewest groups a step commits with
    timeout_s: float = 30.0  # an all-reduce with a dead group fails after this

    def __post_init__(self) -> None:
        if not 0 <= self.replica_id < self.num_replicas:
            raise ValueError(
                f"replica_id must be in [0, {self.num_replicas}), got {self.replica_id}"
            )
        if not 1 <= self.min_replicas <= self.num_replicas:
            raise ValueError(f"min_replicas must be in [1, {self.num_replicas}]")


def group_step(step: int) -> int:
    """``step``, checked to be every rank's of this group (its default process group).

    A heal that succeeds on some ranks of a group and fails on others leaves them at different
    steps, and torchft does not bring them back together: under load in CI a group's two
    ranks went on at steps 6, 12, 13, ... and 9, 11, 15, ..., their shards from different
    states. Raising fails the group instead, so torchrun restarts it and it heals whole.
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return step
    steps: list[int] = [0] * dist.get_world_size()
    dist.all_gather_object(steps, step)  # torch puts the bytes on the backend's device
    low, high = min(steps), max(steps)
    if high != low:
        raise RuntimeError(
            f"the ranks of this replica group stand at steps {low} to {high} after a quorum "
            f"(this rank: {step}): a heal failed on some of them; the group stops so that "
            "torchrun restarts it and it heals from a peer whole"
        )
    return step


class FaultTolerantGroups:
    """The loop's hooks into torchft for one rank (module docstring)."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        group: FTGroup,
        rank: int,
        world_size: int,
    ) -> None:
        shards = LocalShards(model, optimizer)  # what a healthy peer hands a rejoining group
        self.params = shards.params
        self._spent: dict[str, list[float]] = {"quorum": [], "all_reduce": [], "commit": []}
        self.manager = group_manager(
            group.replica_id, group.lighthouse, rank, world_size, group.timeout_s,
            group.min_replicas, (shards.load, shards.save),
        )  # fmt: skip

    def resume_at(self, step: int) -> None:
        """Start from ``step`` steps done (this group's checkpoint): the first quorum then
        heals whichever groups are behind the newest, this one included."""
        if step:
            self.manager.load_state_dict({"step": step, "batches_committed": step})

    # ---- the loop's hooks
    def steps(self, total: int) -> Iterator[int]:
        """Steps from the quorum's current one to ``total`` (a healed group's jumps ahead)."""
        while True:
            t0 = time.perf_counter()
            self.manager.start_quorum()
            self._spent["quorum"].append(time.perf_counter() - t0)
            step = group_step(self.manager.current_step())
            if step >= total:
                return
            yield step

    def sync_gradients(self) -> None:
        """Average the gradients' local shards over the groups in the quorum, in the flat
        chunks the other gradient syncs use (`collectives.all_reduce_flat`; one all-reduce a
        parameter cost a millisecond of torchft's own work each on CPU: 46 ms a step for
        gpt-tiny's tensors, against 3 in chunks; the estimate prices the same chunks)."""
        t0 = time.perf_counter()
        grads = [local_shard(p.grad) for p in self.params if p.grad is not None]
        all_reduce_flat(grads, None, reduce=lambda t: self.manager.allreduce(t).wait())
        self._spent["all_reduce"].append(time.perf_counter() - t0)

    def should_commit(self) -> bool:
        t0 = time.perf_counter()
        commit = self.manager.should_commit()
        self._spent["commit"].append(time.perf_counter() - t0)
        return commit

    def costs(self) -> dict[str, float]:
        """Seconds a step in torchft's quorum, gradient all-reduce and commit (medians; the
        first step's, which connects, left out where there are more)."""
        return {k: statistics.median(v[1:] or v) if v else 0.0 for k, v in self._spent.items()}

    def digest(self) -> str:
        """A SHA-256 of this rank's local parameter shards (16 hex digits): equal on the same
        rank of every group that committed the same steps."""
        h = hashlib.sha256()
        for p in self.params:
            h.update(local_shard(p).detach().contiguous().numpy().tobytes())
        return h.hexdigest()[:16]

    def shutdown(self) -> None:
        self.manager.shutdown(wait=False)
