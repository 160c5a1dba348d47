"""A plan's goodput under failures: checkpoint and restart priced, the interval chosen.

In: the model's parameter count, the optimizer, the config, its step time, the cluster and its
`Reliability` (the profile's [reliability] table, or the user's). Out: a `GoodputEstimate`.

    state S     bytes a checkpoint holds: fp32 parameters (or master weights) and the
                optimizer's state, P x (4 + 8 for Adam's two moments, 4 for momentum)
    writes      every rank writes its share (torch.distributed.checkpoint spreads replicated
                state over the replicas): S / (N x storage bandwidth per device)
    staging     a rank copies its local state, S x dp x cp / N, to host memory first
    checkpoint  synchronous: overhead + staging + writes stop training;
                asynchronous (dcp.async_save): overhead + staging stop it, the writes follow
                in the background (the commit lag)
    restart     the profile's relaunch and rendezvous + reading S back
    MTBF        3600 / (N x failure rate per device-hour)

Each mode's interval is the whole number of steps that maximises goodput under Daly's model
(`cost_models.goodput.best_interval`); `goodput` is the better mode's.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from autopar.config import ParallelConfig
from autopar.hardware import Cluster, Reliability
from cost_models.goodput import FailureModel, best_interval

# fp32 parameters or master weights, plus the optimizer's state per parameter (fp32)
STATE_BYTES_PER_PARAM = {"adamw": 12, "adam": 12, "sgd_momentum": 8, "sgd": 4}


@dataclass(frozen=True)
class GoodputEstimate:
    mtbf_s: float
    failure_rate_per_device_hour: float
    checkpoint_bytes: float
    sync_checkpoint_s: float
    async_checkpoint_s: float
    commit_lag_s: float
    restart_s: float
    sync_interval_steps: int
    sync_goodput: float
    async_interval_steps: int
    async_goodput: float

    @property
    def goodput(self) -> float:
        return max(self.sync_goodput, self.async_goodput)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def estimate_goodput(
    num_params: float,
    optimizer: str,
    config: ParallelConfig,
    step_time_s: float,
    cluster: Cluster,
    reliability: Reliability,
) -> GoodputEstimate:
    """The plan's checkpoint, restart, intervals and goodput (module docstring)."""
    n = cluster.world_size
    state = num_params * STATE_BYTES_PER_PARAM[optimizer]
    write_s = state / (n * reliability.storage_bytes_per_s_per_device)
    local = state * config.dp * config.cp / n
    staging_s = local / reliability.host_copy_bytes_per_s
    stall = reliability.checkpoint_overhead_s + staging_s
    mtbf = 3600.0 / (n * reliability.failure_rate_per_device_hour)
    restart = reliability.restart_s + write_s  # reading it back at the write bandwidth
    sync = FailureModel(mtbf, stall + write_s, restart)
    lagged = FailureModel(mtbf, stall, restart, commit_lag_s=write_s)
    sync_steps, sync_goodput = best_interval(step_time_s, sync)
    async_steps, async_goodput = best_interval(step_time_s, lagged)
    return GoodputEstimate(
        mtbf_s=mtbf,
        failure_rate_per_device_hour=reliability.failure_rate_per_device_hour,
        checkpoint_bytes=state,
        sync_checkpoint_s=sync.checkpoint_s,
        async_checkpoint_s=stall,
        commit_lag_s=write_s,
        restart_s=restart,
        sync_interval_steps=sync_steps,
        sync_goodput=sync_goodput,
        async_interval_steps=async_steps,
        async_goodput=async_goodput,
    )


def goodput_interval(goodput: dict[str, float], async_save: bool) -> int | None:
    """A plan's best checkpoint interval in steps for the save mode (`Plan.goodput`, the
    `GoodputEstimate` as a dict); None where the plan priced no failures."""
    value = (goodput or {}).get("async_interval_steps" if async_save else "sync_interval_steps")
    return int(value) if value else None
