"""Measuring what a run does, to hold it against its plan: collectives, state bytes, activations.

In (on every rank of a spawned gloo world): zoo cases. Out, per case: the collectives one
training step issued ({(kind, bytes per call): calls}), this rank's parameter, gradient and
optimizer-state bytes after the step, and the bytes one micro-batch's forward saved for
backward (activations, parameters excluded).

Collectives are caught by a dispatch mode built like `CommDebugMode` that records sizes:
DTensor's functional collectives and the c10d ops FSDP2 and the trainer call. One step's
collectives are those of a two-step run minus those of a one-step run (set-up --
distribute_tensor, fully_shard -- and the last step's logging cancel out).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from harness import Case, task_of, tp_of
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from autopar.runtime.mesh import build_mesh
from autopar.runtime.tp_apply import loss_context
from autopar.runtime.trainer import TrainOptions, parallelize_model, train

Key = tuple[str, float]  # (kind, bytes per call)


def _bytes(t: Any) -> float:
    if isinstance(t, torch.Tensor):
        return float(t.numel() * t.element_size())
    if isinstance(t, (list, tuple)):
        return sum(_bytes(x) for x in t)
    return 0.0


# op name -> (kind, index of the argument whose bytes are the whole buffer, scale by group size)
_OPS = {
    "all_reduce": ("all_reduce", 0, False),
    "allreduce_": ("all_reduce", 0, False),
    "all_gather_into_tensor": ("all_gather", 0, True),
    "_allgather_base_": ("all_gather", 0, False),
    "allgather_into_tensor_coalesced_": ("all_gather", 0, False),
    "reduce_scatter_tensor": ("reduce_scatter", 0, False),
    "_reduce_scatter_base_": ("reduce_scatter", 1, False),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1, False),
    "allgather_": ("all_gather", 0, False),
    "reduce_scatter_": ("reduce_scatter", 1, False),
    "all_to_all_single": ("all_to_all", 0, False),
    "alltoall_base_": ("all_to_all", 1, False),
    "broadcast_": ("broadcast", 0, False),
    # pipeline p2p: torch.distributed.pipelining's batch_isend_irecv runs one isend / irecv
    # per tensor on gloo (no coalescing), each a c10d::send / recv_ op
    "send": ("send", 0, False),
    "recv_": ("recv", 0, False),
}


class SizedCommMode(TorchDispatchMode):
    """Records (kind, bytes) of every collective issued on plain tensors. As `CommDebugMode`
    does, it lets DTensor ops through first (NotImplemented), so it sees the collectives they
    turn into; unlike it, it keeps no module tracker (models are built inside the mode)."""

    def __init__(self) -> None:
        super().__init__()
        self.sized: Counter[Key] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        if any(t is DTensor for t in types):
            return NotImplemented
        out = func(*args, **(kwargs or {}))
        packet = getattr(func, "_overloadpacket", None)
        name = getattr(packet, "__name__", "")
        if name in _OPS and "c10d" in str(func):
            kind, index, scale = _OPS[name]
            nbytes = _bytes(args[index])
            if scale:  # functional all_gather_into_tensor(input, group_size, group)
                nbytes *= args[1]
            self.sized[(kind, nbytes)] += 1
        return out


def _comm_of_steps(case: Case, steps: int) -> tuple[Counter[Key], dict[str, float]]:
    mode = SizedCommMode()
    with mode:
        results = train(
            task_of(case),
            case.config,
            case.global_batch_size,
            options=TrainOptions(steps=steps, log=False, precision=case.precision),
            tp=tp_of(case),
        )
    return mode.sized, results[-1].memory_bytes


def saved_activation_bytes(case: Case) -> float:
    """Bytes one micro-batch's forward (with the loss) saves for backward on this rank,
    parameters (and their gathered or transposed views) excluded, each storage once."""
    task = task_of(case)
    mesh = build_mesh(case.config)
    model = task.build()
    pm = parallelize_model(model, mesh, case.config, tp=tp_of(case))
    inputs, targets = task.batch(0, 0, case.config.micro_batch_size)
    seen: dict[int, float] = {}

    def storage_of(t: torch.Tensor) -> tuple[int, float]:
        local = t.to_local() if isinstance(t, DTensor) else t
        try:
            st = local.untyped_storage()
            return st.data_ptr(), float(st.nbytes())
        except RuntimeError:  # a storage-less wrapper (functional collective output)
            return id(local), float(local.numel() * local.element_size())

    def pack(t: torch.Tensor) -> torch.Tensor:
        params = {storage_of(p)[0] for p in model.parameters()}
        ptr, nbytes = storage_of(t)
        if ptr not in params and nbytes:
            seen[ptr] = nbytes
        return t

    cp = pm.context_parallel
    with loss_context(pm.tp_plan), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        if cp is not None:  # this rank's sequence shard at its global positions (trainer's way)
            inputs, targets, positions = cp.shard_batch(inputs, targets)
            loss = cp.loss(pm.model(*inputs, positions=positions), targets)
        else:
            loss = task.loss(task.forward(model, inputs), targets)
    del loss
    return sum(seen.values())


def measure(cases: list[Case]) -> list[dict[str, Any]]:
    """On every rank: per case, one step's collectives, state bytes and saved activations."""
    out = []
    for case in cases:
        one, _ = _comm_of_steps(case, 1)
        two, memory = _comm_of_steps(case, 2)
        step = Counter({k: two[k] - one.get(k, 0) for k in two if two[k] - one.get(k, 0)})
        out.append(
            {
                "comm": dict(step),
                "memory": memory,
                # pp > 1: a chunk's saved bytes need the schedule; bf16: the trainer's
                # autocast; neither measured here
                "activations": saved_activation_bytes(case)
                if case.config.pp == 1 and case.precision == "fp32"
                else None,
            }
        )
    return out
