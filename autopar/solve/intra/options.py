"""Options of the intra-layer solve: a frozen dataclass, part of the cache key."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class IntraOptions:
    """How one layer is planned on its tensor-parallel sub-mesh.

    Attributes:
        sequence_parallel: the layer's boundary activations are Shard(sequence_dim) instead of
            Replicate (Megatron-LM sequence parallelism, Korthikanti et al. 2022).
        sequence_dim: the sequence dim of the boundary activations ([B, S, H] -> 1).
        memory_budget_bytes: per-rank cap on parameter bytes (times `param_memory_factor`)
            plus saved activation bytes of this layer; None for no cap.
        param_memory_factor: bytes held per parameter byte (1: weights only; with bf16 weights,
            bf16 grads and fp32 Adam states plus master weights it is 1 + 1 + 6 = 8).
        micro_batch_size: samples per micro-batch; FLOPs, activation bytes and activation
            messages scale with it (the traced graph holds one sample).
        recompute: which `LayerInfo.saved_values` policy sets the saved activations.
        precision: the training dtype ("bf16", "fp16", "fp32"): floating ops are priced at it
            and floating tensors count its bytes, whatever dtype the graph was traced in (the
            step estimator's `act_scale`, so both price the same layer); None: as traced.
        weight_grad_sync: charge an all-reduce of a replicated weight's gradient whenever a
            strategy leaves that gradient Partial (work split over tokens, say).
        no_folding: keep trivial ops as ILP nodes of their own (for tests and comparisons).
        unit_s: the integer cost unit of the ILP (1e-9: nanoseconds).
        time_limit_s: CP-SAT's wall-clock limit.
        num_workers: CP-SAT search workers; 1 (the default) makes the search deterministic, so
            equal inputs give the same plan even where optima tie.
    """

    sequence_parallel: bool = False
    sequence_dim: int = 1
    memory_budget_bytes: float | None = None
    param_memory_factor: float = 1.0
    micro_batch_size: int = 1
    recompute: Literal["none", "selective", "full"] = "none"
    precision: Literal["bf16", "fp16", "fp32"] | None = None
    weight_grad_sync: bool = True
    no_folding: bool = False
    unit_s: float = 1e-9
    time_limit_s: float = 10.0
    num_workers: int = 1

    def __post_init__(self) -> None:
        if self.micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {self.micro_batch_size}")
        if self.precision not in (None, "bf16", "fp16", "fp32"):
            raise ValueError(f"precision must be bf16, fp16, fp32 or None, got {self.precision!r}")
        if self.memory_budget_bytes is not None and self.memory_budget_bytes <= 0:
            raise ValueError(f"memory_budget_bytes must be > 0, got {self.memory_budget_bytes}")
        if self.unit_s <= 0 or self.time_limit_s <= 0 or self.num_workers < 1:
            raise ValueError(
                f"unit_s ({self.unit_s}), time_limit_s ({self.time_limit_s}) and num_workers "
                f"({self.num_workers}) must be positive"
            )
