"""DiLoCo across replica groups with torchft: each group trains its own plan, an outer step
every H inner steps.

In: this rank's model (already parallelised inside its group: FSDP2, TP, ... over the group's
own process group), its inner optimizer, and a `DiLoCoGroup` (which group this is, how many,
the lighthouse's address, H, fragments, the outer optimizer's settings). Out: a context that,
entered around the training loop, runs torchft's DiLoCo on the inner optimizer's steps (its
post-step hook counts them and, every H, all-reduces each fragment's pseudo-gradient over the
groups and takes the outer Nesterov step), and an `OuterTraffic` record of the bytes each
all-reduce between groups moved from this rank; `outer_state` / `load_outer_state`: this rank's
DiLoCo state beyond the model and the inner optimizer, for its checkpoint; `Position`: where
the loop stands, which brings a group behind the others to their step at its first outer step
(`replicas.ReplicaRun` drives it).

The groups are separate torch.distributed jobs (each its own torchrun, or its own spawned
world in the tests): a group's rank r all-reduces with rank r of every other group through a
torchft `Manager` (its quorum from the lighthouse, its fault-tolerant gloo process group),
which uses the group's own TCPStore (MASTER_ADDR / MASTER_PORT) for its rendezvous. The
lighthouse is started once for the run (`torchft_lighthouse`, or `LighthouseServer` in
tests). The plan's figure for the traffic: `autopar.estimate.algorithms` (P x 4 bytes per
outer step, summed over a group's ranks, each parameter's local shard once).

Written on torchft's own classes: the Manager (quorum, healing, the fault-tolerant process
group) and DiLoCo (fragments, backups, the outer step) are torchft's; what is ours is wiring
them to an autopar group and counting the bytes they send.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from autopar.runtime.replica_groups import LocalShards, group_manager


@dataclass(frozen=True)
class DiLoCoGroup:
    """This rank's replica group in a DiLoCo run (module docstring)."""

    replica_id: int  # 0 .. num_replicas - 1
    num_replicas: int
    lighthouse: str  # "http://host:port"
    inner_steps: int  # H
    fragments: int = 1  # F: the model's blocks split in F fragments, synced in turn
    outer_lr: float = 0.7  # the DiLoCo paper's Nesterov outer step
    outer_momentum: float = 0.9
    timeout_s: float = 60.0

    def __post_init__(self) -> None:
        if not 0 <= self.replica_id < self.num_replicas:
            raise ValueError(
                f"replica_id must be in [0, {self.num_replicas}), got {self.replica_id}"
            )
        if self.inner_steps < 1 or self.fragments < 1 or self.inner_steps % self.fragments:
            raise ValueError(
                f"inner_steps ({self.inner_steps}) must be a multiple of fragments "
                f"({self.fragments}), both >= 1"
            )


@dataclass
class OuterTraffic:
    """The bytes this rank's all-reduces between groups moved (the local shard of each
    fragment's pseudo-gradient, as torchft hands it to the fault-tolerant group)."""

    bytes: float = 0.0


def fragments_of(model: nn.Module, blocks: list[nn.Module], count: int) -> list[nn.Module]:
    """The model as ``count`` fragments: consecutive runs of its blocks, the first holding
    the parameters outside the blocks too (embeddings, final norm, head). One fragment is
    the model itself."""
    if count == 1:
        return [model]
    if len(blocks) < count:
        raise ValueError(
            f"{count} DiLoCo fragments need as many blocks, the model has {len(blocks)}"
        )
    inside = {id(p) for b in blocks for p in b.parameters()}
    rest = [p for p in model.parameters() if id(p) not in inside]
    size = len(blocks) // count
    runs = [blocks[i * size : (i + 1) * size if i < count - 1 else None] for i in range(count)]
    out: list[nn.Module] = []
    for i, run in enumerate(runs):
        fragment = nn.Module()
        fragment.blocks = nn.ModuleList(run)
        if i == 0 and rest:
            fragment.rest = nn.ParameterList(rest)
        out.append(fragment)
    return out


def attach_diloco(
    model: nn.Module,
    blocks: list[nn.Module],
    inner: torch.optim.Optimizer,
    group: DiLoCoGroup,
    rank: int,
    world_size: int,
) -> tuple[Any, OuterTraffic]:
    """torchft's DiLoCo for this rank (enter it around the training loop) and its traffic
    record. ``rank``, ``world_size``: this rank's in its group."""
    # imported here: torchft is an optional dependency of the DiLoCo path only
    from torchft.local_sgd import DiLoCo

    # every group in every outer step; a group behind the others at an outer step's quorum is
    # handed a peer's local shards (`Position`); no copy at step 0, where every group starts
    # alike (seeded), and a copy then would land mid-period
    shards = LocalShards(model, inner)
    manager = group_manager(
        group.replica_id, group.lighthouse, rank, world_size, group.timeout_s,
        group.num_replicas, (shards.load, shards.save), init_sync=False,
    )  # fmt: skip
    traffic = OuterTraffic()
    sends = manager.allreduce

    def counted(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        traffic.bytes += float(tensor.numel() * tensor.element_size())
        return sends(tensor, *args, **kwargs)

    manager.allreduce = counted  # type: ignore[method-assign]
    # as many fragments as asked where this rank holds the blocks (a pipeline chunk may hold
    # fewer), a divisor of H as torchft requires
    most = min(group.fragments, max(1, len(blocks)))
    count = max(d for d in range(1, most + 1) if group.inner_steps % d == 0)
    parts = fragments_of(model, blocks, count)
    outer = [
        torch.optim.SGD(
            p.parameters(), lr=group.outer_lr, momentum=group.outer_momentum, nesterov=True
        )
        for p in parts
    ]
    # streaming (several fragments): each fragment's all-reduce overlaps the next inner step
    # (torchft's fragment_sync_delay, the paper's tau), where H leaves room for it
    delay = 1 if count > 1 and group.inner_steps // count > 1 else 0
    context = DiLoCo(
        manager, parts, inner, outer, sync_every=group.inner_steps, backup_device=None,
        pin_memory=False, fragment_sync_delay=delay,
    )  # fmt: skip
    return context, traffic


class Position:
    """Where this group's loop stands, handed to a healing peer beside torchft's own state:
    ``done``, the steps done once the step in flight completes.

    A group behind the others -- resumed from an older checkpoint than theirs, or from none,
    or restarted while they train -- runs from where it stands until its first outer step,
    whose quorum (every group's: the others wait there) hands it a peer's state: its model and
    inner optimizer shards, each fragment's outer parameters and momentum, torchft's step, and
    this record, so that it goes on from the peer's step (`healed`, read once; `pending`
    without taking it). torchft's synchronous quorum counts it as taking part in that outer
    step, with the peer's pseudo-gradient. A group level with the others takes no state: from a
    checkpoint of their current period, it redoes those steps and takes part with its own."""

    KEY = "autopar_loop"

    def __init__(self, context: Any, done: int) -> None:
        self.done, self.pending = done, None
        context._manager.register_state_dict_fn(self.KEY, self._load, self._save)

    def _save(self) -> dict[str, int]:
        return {"done": self.done}

    def _load(self, state: dict[str, int]) -> None:
        self.pending = int(state["done"])

    def healed(self) -> int | None:
        healed, self.pending = self.pending, None
        return healed


# torchft has no public call for DiLoCo's state: its Manager's `_user_state_dicts` and
# `_load_state_dict_fns` (what its checkpoint transport sends a healing peer, and how that peer
# takes it in) and DiLoCo's `_local_step` are read here as torchft itself uses them
FRAGMENT = "StreamingDiLoCoFragment_"


def outer_state(context: Any) -> dict[str, Any]:
    """This rank's DiLoCo state that the model and the inner optimizer do not hold: torchft's
    own checkpoint of it (what its Manager hands a healing peer, less the model's shards the
    checkpoint holds already: each fragment's parameters at its last outer step -- this rank's
    local shards -- and its outer optimizer's momentum; the Manager's step, which picks the
    next fragment to sync) and the inner steps since the last sync. Read after an optimizer
    step (torchft's hooks allow it then)."""
    manager = context._manager
    user = {k: save() for k, save in manager._user_state_dicts.items() if k.startswith(FRAGMENT)}
    return {
        "torchft": {"user": user, "torchft": manager.state_dict()},
        "local_step": context._local_step,
    }


def load_outer_state(context: Any, state: dict[str, Any]) -> None:
    """Put `outer_state`'s ``state`` back into a freshly attached DiLoCo ``context``.

    Raises:
        ValueError: the state was saved under another layout (other fragments, or other
            local shards of their parameters): it is this rank's own and cannot be resharded.
    """
    manager, saved = context._manager, state["torchft"]["user"]
    if len(saved) != len(context._fragments):
        raise ValueError(
            f"the checkpoint's DiLoCo outer state has {len(saved)} fragment(s), this run "
            f"{len(context._fragments)}: resume under the plan and ranks it was saved with"
        )
    for i, fragment in enumerate(context._fragments):
        theirs = saved[f"{FRAGMENT}{i}"]["original_parameters"]
        for name, mine in fragment.original_parameters.items():
            there = tuple(theirs[name].shape) if name in theirs else None
            if there != tuple(mine.shape):
                raise ValueError(
                    f"the checkpoint's DiLoCo outer state holds {name} of fragment {i} as "
                    f"{there}, this rank as {tuple(mine.shape)}: resume under the plan and "
                    "ranks it was saved with (the state is this rank's own shards)"
                )
    for key, load in manager._load_state_dict_fns.items():
        if key.startswith(FRAGMENT):
            load(saved[key])
    manager.load_state_dict(state["torchft"]["torchft"])
    context._local_step = int(state["local_step"])
