"""The training loop's side of replica groups: DiLoCo or fault-tolerant groups, or neither.

In: the `TrainOptions` (`diloco` or `ft`), the global batch, and once the model is made, this
rank's model, blocks, optimizer, rank and world in its group. Out: `replica_share` (this group's
share of each step's global batch and where it starts) and `ReplicaRun`: where and how often
this group checkpoints (`ReplicaRun.checkpoint`), the state its checkpoints hold beside the
model and optimizer (DiLoCo's, handed to the run's `Checkpointer`), and the hooks
`trainer.train` calls each step -- which steps to run, the gradient average over the groups,
whether to commit, the bytes sent to other groups -- all no-ops without replica groups.

Checkpoints with replica groups: each group saves and resumes its own, under
``<directory>/group<g>`` (a group is one torchrun job, so DCP's collectives are its own; a
group that is down saves nothing, and the others' checkpoints do not wait for it).
- Fault-tolerant groups: a group that resumes hands its step to torchft's Manager, and the
  first quorum heals any group behind the newest -- one restarted from an older checkpoint, or
  from none -- from a peer at that step. So a whole job stopped and started again goes on from
  the newest checkpoint any group holds, and a single group restarted while the others run
  heals from them as before (its own checkpoint read first, then overwritten).
- DiLoCo: each rank's checkpoint also holds its outer state (`diloco.outer_state`: the
  parameters of each fragment's last outer step, the outer momentum, torchft's step), read
  back after the model, so a run stopped and started again takes the same outer steps as one
  never stopped. Saves land on outer-step boundaries only (the interval rounded up to a
  multiple of H), where no fragment's all-reduce is in flight; every group saves at the same
  steps, so a job started again resumes them together. A group behind the others -- its
  newest checkpoint older than theirs, or none, or restarted while they train -- runs from
  where it stands to its first outer step, where the others wait for it; that quorum heals it
  from a peer (model and optimizer shards, outer state, `diloco.Position`) and the loop jumps
  to their step (`steps`; its next checkpoint is labelled so, `done`). A group level with them
  (a checkpoint of their current period) redoes those steps and takes part with its own.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

from torch import nn

from autopar.runtime.diloco import (
    DiLoCoGroup,
    Position,
    attach_diloco,
    load_outer_state,
    outer_state,
)
from autopar.runtime.fault_tolerance import FaultTolerantGroups, FTGroup

__all__ = ["DiLoCoGroup", "FTGroup", "ReplicaRun", "replica_share"]


def replica_share(options: Any, global_batch_size: int) -> tuple[int, int]:
    """(this group's batch per step, the sample it starts at): the whole batch from 0 without
    replica groups. Raises ValueError for what replica groups do not run."""
    group = options.diloco or options.ft
    if group is None:
        return global_batch_size, 0
    if options.diloco and options.ft:
        raise ValueError("DiLoCo and fault-tolerant groups are one or the other")
    if global_batch_size % group.num_replicas:
        raise ValueError(
            f"global batch {global_batch_size} does not split over {group.num_replicas} "
            "replica groups"
        )
    share = global_batch_size // group.num_replicas
    return share, group.replica_id * share


class ReplicaRun:
    """This rank's replica-group hooks for one run (module docstring)."""

    @staticmethod
    def checkpoint(options: Any, log: bool = False) -> Any:
        """The `CheckpointOptions` this rank saves and resumes under: a replica group's own
        subdirectory, DiLoCo's interval a multiple of H (module docstring; said when ``log``),
        else ``options.checkpoint`` as given."""
        group, checkpoint = options.ft or options.diloco, options.checkpoint
        if group is None or checkpoint is None:
            return checkpoint
        where = str(Path(checkpoint.directory) / f"group{group.replica_id}")
        every, h = checkpoint.every, options.diloco.inner_steps if options.diloco else 1
        rounded = -(-every // h) * h
        if rounded != every and log:
            print(
                f"[autopar] checkpoints every {rounded} steps, not {every}: DiLoCo saves on "
                f"its outer steps (every {h})",
                flush=True,
            )
        return replace(checkpoint, directory=where, every=rounded)

    def __init__(
        self,
        options: Any,
        pm: Any,
        optimizer: Any,
        rank: int,
        world: int,
        resumed: int = 0,
        checkpointer: Any = None,
    ) -> None:
        """``pm``: the `parallelize.ParallelModel` (its model and its blocks' paths);
        ``resumed``: the steps this group's checkpoint had done (torchft's step starts there);
        ``checkpointer``: the run's `checkpoint.Checkpointer` (None: no checkpoints), which
        gives back DiLoCo's outer state it resumed and saves it from now on."""
        model: nn.Module = pm.model
        named = set(pm.blocks)
        blocks = [m for path, m in model.named_modules() if path in named]
        self.context = contextlib.ExitStack()
        self.traffic = self.groups = self.position = None
        self.ft, self.log = options.ft, options.log and rank == 0
        if options.diloco is not None:  # torchft's DiLoCo on the inner optimizer's steps
            diloco, self.traffic = attach_diloco(
                model, blocks, optimizer, options.diloco, rank, world
            )
            outer = checkpointer.resumed_extra if checkpointer else None
            if outer is not None:  # after the model's weights: their outer step's, and momentum
                load_outer_state(diloco, outer)
            elif resumed and self.log:
                print(
                    f"[autopar] DiLoCo: the checkpoint of step {resumed} holds no outer state "
                    "(saved by another kind of run): the outer steps start from its weights",
                    flush=True,
                )
            self.context.enter_context(diloco)
            self.position = Position(diloco, resumed)  # handed to a peer that heals from here
            if checkpointer is not None:  # saved beside the model at each checkpoint
                checkpointer.extra = lambda: outer_state(diloco)
        if options.ft is not None:
            self.groups = FaultTolerantGroups(model, optimizer, options.ft, rank, world)
            self.groups.resume_at(resumed)
            self.context.callback(self.groups.shutdown)
        self.rank = rank

    def steps(self, first: int, total: int) -> Iterable[int]:
        """The steps to run: from torchft's quorum with ft groups (a healed group's from its
        peers'); with DiLoCo from ``first``, jumping to the others' step where this group was
        behind them and was healed at an outer step (`diloco.Position`); else ``first`` ..
        ``total`` - 1."""
        if self.groups:
            return self.groups.steps(total)
        if self.position is not None:
            return self._diloco_steps(first, total)
        return range(first, total)

    def _diloco_steps(self, step: int, total: int) -> Iterator[int]:
        while step < total:
            self.position.done = step + 1  # what a peer healing during this step is told
            yield step
            step += 1
            if (healed := self.position.healed()) is not None and healed != step:
                if self.log:
                    print(
                        f"[autopar] DiLoCo: healed from a peer at its step {healed} (this "
                        f"group stood at {step}): its model, optimizer and outer state",
                        flush=True,
                    )
                step = healed

    def done(self, steps: int) -> int:
        """The steps this group's state stands for once a step ends that ran ``steps``: the
        peer's where an outer step in it healed the group (what a checkpoint is labelled)."""
        pending = self.position.pending if self.position is not None else None
        return pending if pending is not None else steps

    def sync_gradients(self) -> None:
        if self.groups is not None:  # averaged over the groups alive
            self.groups.sync_gradients()

    def commit(self, step: int, log: bool) -> bool:
        """Whether 0-based ``step``'s optimizer step may be taken (false: a group failed
        mid-step; said when ``log``)."""
        if self.groups is None or self.groups.should_commit():
            return True
        if log:
            print(f"[autopar] step {step + 1}: dropped (a replica group failed)", flush=True)
        return False

    @property
    def bytes_sent(self) -> float:
        """The bytes this rank has all-reduced with the other DiLoCo groups so far."""
        return self.traffic.bytes if self.traffic is not None else 0.0

    def close(self, log: bool) -> None:
        """Print the ft digest line (replicas that committed alike hold alike) and detach."""
        if self.groups is not None and log:
            print(
                f"[autopar] replica group {self.ft.replica_id}, rank {self.rank}: parameters "
                f"{self.groups.digest()} after step {self.groups.manager.current_step()}",
                flush=True,
            )
            spent = self.groups.costs()
            print(
                f"[autopar] torchft a step (median): quorum {spent['quorum'] * 1e3:.2f} ms, "
                f"gradient all-reduce {spent['all_reduce'] * 1e3:.2f} ms, commit "
                f"{spent['commit'] * 1e3:.2f} ms",
                flush=True,
            )
        self.context.close()
