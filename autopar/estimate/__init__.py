"""estimate: the cost model applied to a traced model on a cluster.

build_tables(ModelGraph) -> ModelTables                     once per model and shape
Estimator(tables, cluster, ...).evaluate(config, global_batch_size) -> Estimate
Estimator(...).evaluate_stages([StageMesh, ...], global_batch, micro_batch) -> Estimate

tables.py         per-layer cost tables (FLOPs, bytes, tp shard classes, activations)
saved_split.py    a layer's saved activations by recompute policy and shard class
module_regions.py the parts of a block Megatron-Core's module recompute names, from the trace
layer_cost.py     one layer's time under a config (compute, TP/CP/EP collectives)
stages.py         model chunks, pipeline stages, the layers a policy recomputes
stage_time.py     stage times, the pipeline, the data-parallel tail, the breakdown
memory.py         parameters on a rank, peak memory per stage
step.py           `Estimator`: the parts above in order, with caches for the search
staged.py         pipelines whose stages have meshes and cuts of their own (Aceso's plans)
communication.py  the collectives one step issues per stage (what a run is checked against)
mesh.py           the config's process groups on the cluster, priced per axis
layout.py         how the mesh axes lie on the topology, for the plan's text
pipeline_timer.py the pipeline simulation, cached
options.py        `CostOptions`: the training stack's overlaps, buffers and reserve
"""

from __future__ import annotations

from autopar.estimate.options import CostOptions
from autopar.estimate.stacks import Stack, load_stack, stack_names
from autopar.estimate.staged import StageMesh, StagePart
from autopar.estimate.step import Estimate, Estimator, StageEstimate
from autopar.estimate.tables import ModelTables, build_tables

__all__ = [
    "CostOptions",
    "Estimate",
    "Estimator",
    "ModelTables",
    "Stack",
    "StageEstimate",
    "StageMesh",
    "StagePart",
    "build_tables",
    "load_stack",
    "stack_names",
]
