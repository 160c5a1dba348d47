"""The device mesh of a plan: torchrun's environment + a ParallelConfig -> a named DeviceMesh.

In: the environment torchrun sets (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) and
a `ParallelConfig`. Out: a `RuntimeMesh`, a `torch.distributed.device_mesh.DeviceMesh` with the
axes "pp", "dp", "fsdp", "cp", "tp" (outer to inner, every axis present, size 1 included) and
the coordinates of this rank.

Invariant: the rank layout is `autopar.estimate.mesh.MeshGroups`' -- the non-pipeline axes in
the config's `axis_order`, innermost (stride 1) first (default tp, cp, fsdp, dp), pp outermost
-- because the mesh is `arange(world)` reshaped to pp and the axes outer to inner, then permuted
to the named dims (pp, dp, fsdp, cp, tp), so a group the planner priced (say tp inside a node,
or fsdp inside it and tp across) is the group the program uses. The dims keep their names and
order whatever the layout; only which ranks sit at which coordinates changes.

Public functions:
    init_distributed(device=None, timeout_s=None) -> (rank, world_size, device)  # from torchrun
    collective_timeout() -> timedelta | None                      # the default group's
    device_mesh(device_type, layout, names) -> DeviceMesh         # its groups take that
    shutdown_distributed()                                        # barrier, then destroy it
    free_port() -> int                                            # a loopback port for local ranks
    rank_environment(rank, world_size, port) -> dict              # torchrun's variables, by hand
    build_mesh(config, device_type=None) -> RuntimeMesh           # refuses a wrong world size;
                                                                  # its groups take the timeout
    mesh_layout(config) -> tensor [pp, dp, fsdp, cp, tp] of ranks  # in the plan's axis order
    check_world_size(config, world_size)                          # the clear error, alone
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import Backend as C10dBackend
from torch.distributed.device_mesh import DeviceMesh

from autopar.config import ParallelConfig
from autopar.errors import AutoparError

AXES = ("pp", "dp", "fsdp", "cp", "tp")  # outer to inner
DATA_AXES = ("dp", "fsdp")  # ranks that see different samples


class WorldSizeError(AutoparError, RuntimeError):
    """The program runs on a different number of ranks than the plan was made for."""


def check_world_size(config: ParallelConfig, world_size: int) -> None:
    """Raise WorldSizeError unless ``world_size`` equals the plan's dp*fsdp*cp*tp*pp."""
    if world_size != config.world_size:
        raise WorldSizeError(
            f"the plan needs {config.world_size} ranks (pp={config.pp} x dp={config.dp} x "
            f"fsdp={config.fsdp} x cp={config.cp} x tp={config.tp}) but torchrun started "
            f"{world_size} (WORLD_SIZE={world_size}); launch with --nproc-per-node x --nnodes = "
            f"{config.world_size}"
        )


def free_port() -> int:
    """A free TCP port on 127.0.0.1 (the OS picks it) for a local group's MASTER_PORT."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_environment(rank: int, world_size: int, port: int) -> dict[str, str]:
    """The variables torchrun sets for a rank of one local node, for ranks started another
    way (torch.multiprocessing spawn): `init_distributed` then reads them as under torchrun."""
    return {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": str(rank),
    }


def shutdown_distributed() -> None:
    """Wait for every rank, then destroy the default process group.

    A rank that exits while a peer still has a pipeline send or receive in flight, or with
    gloo's worker threads alive, can die in C++ ("terminate called without an active
    exception") and fail the whole torchrun; ending on a barrier and a clean destroy avoids it.
    """
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def init_distributed(
    device: str | None = None, timeout_s: float | None = None
) -> tuple[int, int, torch.device]:
    """Initialise the default process group from torchrun's environment (once per process).

    Backend: nccl when the device is a CUDA GPU, gloo otherwise. ``device`` "cpu" or "cuda"
    forces one; by default CUDA is used when available, each rank on GPU LOCAL_RANK.
    ``timeout_s``: how long a collective waits for its peers before it fails (default torch's:
    30 min on gloo, 10 on NCCL); the mesh's and the runtime's own groups take the same
    (`collective_timeout`).

    Returns:
        (rank, world_size, the torch.device this rank computes on).

    Raises:
        WorldSizeError: RANK / WORLD_SIZE are not set (not started by torchrun).
    """
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    dev = torch.device(device, local_rank) if device == "cuda" else torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if not dist.is_initialized():
        missing = [
            k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ
        ]
        if missing:
            raise WorldSizeError(
                f"torchrun's environment is missing {', '.join(missing)}: start the program "
                "with torchrun --nproc-per-node=N (see the program's docstring)"
            )
        backend = "nccl" if dev.type == "cuda" else "gloo"
        dist.init_process_group(
            backend=backend,
            rank=int(os.environ["RANK"]),
            world_size=int(os.environ["WORLD_SIZE"]),
            device_id=dev if dev.type == "cuda" else None,
            timeout=None if timeout_s is None else timedelta(seconds=timeout_s),
        )
    return dist.get_rank(), dist.get_world_size(), dev


def collective_timeout() -> timedelta | None:
    """The default process group's collective timeout, for the groups made after it; None
    when no group is up or its backend does not say.

    torch gives a group made by `new_group` (and so every DeviceMesh dimension) its own
    default, 30 minutes on gloo and 10 on NCCL, whatever `init_process_group` was given: a
    deadlock inside a tensor- or pipeline-parallel group would wait that long however short the
    job asked for. The runtime passes this to each group it makes. Read from the backend's
    options (`_timeout`, as DeviceMesh itself reads a dimension's): no public accessor exists.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return None
    group = dist.distributed_c10d._get_default_group()
    device = torch.device("cuda" if dist.get_backend() == "nccl" else "cpu")
    try:
        return group._get_backend(device).options._timeout
    except (AttributeError, RuntimeError):  # a backend without options: torch's defaults
        return None


def device_mesh(device_type: str, layout: torch.Tensor, names: tuple[str, ...]) -> DeviceMesh:
    """A DeviceMesh over ``layout`` whose dimensions' groups take `collective_timeout`."""
    timeout = collective_timeout()
    override = None
    if timeout is not None:  # NCCL takes its own options type; gloo reads only the timeout
        if dist.get_backend() == "nccl":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
        else:
            options = C10dBackend.Options(dist.get_backend(), timeout)
        override = tuple((None, options) for _ in names)
    return DeviceMesh(device_type, layout, mesh_dim_names=names, backend_override=override)


@dataclass(frozen=True)
class RuntimeMesh:
    """The plan's DeviceMesh and this rank's place in it.

    `coords[axis]` is this rank's index along an axis; `data_rank` its index among the
    dp*fsdp ranks that see different samples (dp outer, fsdp inner), `num_data_ranks` their
    count.
    """

    mesh: DeviceMesh
    config: ParallelConfig
    rank: int
    coords: dict[str, int]

    def size(self, axis: str) -> int:
        return self.mesh.size(AXES.index(axis))

    def __getitem__(self, axes: str | tuple[str, ...]) -> DeviceMesh:
        return self.mesh[axes]

    @property
    def data_rank(self) -> int:
        return self.coords["dp"] * self.size("fsdp") + self.coords["fsdp"]

    @property
    def num_data_ranks(self) -> int:
        return self.size("dp") * self.size("fsdp")

    @property
    def pp_rank(self) -> int:
        return self.coords["pp"]

    def group(self, axis: str) -> dist.ProcessGroup:
        """The process group of ``axis`` that holds this rank."""
        return self.mesh.get_group(axis)

    def as_text(self) -> str:
        shape = " x ".join(f"{a}={self.size(a)}" for a in AXES)
        where = ", ".join(f"{a}={self.coords[a]}" for a in AXES)
        return f"mesh {shape} on {self.mesh.device_type}; rank {self.rank} at ({where})"


def mesh_layout(config: ParallelConfig) -> torch.Tensor:
    """The ranks indexed [pp, dp, fsdp, cp, tp]: rank = sum of coordinate x the axis' stride
    (`ParallelConfig.strides`, from the plan's axis order).

    >>> mesh_layout(ParallelConfig(dp=2, tp=2, axis_order=("dp", "tp", "cp", "fsdp")))[0, :, 0, 0]
    tensor([0, 1])
    """
    outer_to_inner = ("pp", *reversed(config.order))
    layout = torch.arange(config.world_size).reshape([getattr(config, a) for a in outer_to_inner])
    return layout.permute([outer_to_inner.index(a) for a in AXES]).contiguous()


def build_mesh(config: ParallelConfig, device_type: str | None = None) -> RuntimeMesh:
    """The plan's mesh over the initialised default process group.

    Args:
        config: the plan's ParallelConfig; its world size must equal the process group's.
        device_type: "cpu" or "cuda"; default: the backend's (nccl -> cuda, else cpu).
        Each dimension's group takes the default group's timeout (`collective_timeout`).

    Raises:
        WorldSizeError: the world size differs from the plan's (the message names both).
    """
    if not dist.is_initialized():
        init_distributed(device_type)
    world_size = dist.get_world_size()
    check_world_size(config, world_size)
    if device_type is None:
        device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
    mesh = device_mesh(device_type, mesh_layout(config), AXES)
    rank = dist.get_rank()
    coords = mesh.get_coordinate()
    assert coords is not None  # every rank is in the mesh: it spans the world
    return RuntimeMesh(mesh, config, rank, dict(zip(AXES, coords, strict=True)))
