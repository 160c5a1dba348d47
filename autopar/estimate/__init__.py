"""estimate: the cost phase applied to a traced model.

build_tables(ModelGraph) -> ModelTables              once per model and shape
Estimator(tables, cluster, ...).evaluate(config, global_batch_size) -> Estimate
"""

from __future__ import annotations

from autopar.estimate.options import CostOptions
from autopar.estimate.step import Estimate, Estimator, StageEstimate
from autopar.estimate.tables import ModelTables, build_tables

__all__ = ["CostOptions", "Estimate", "Estimator", "ModelTables", "StageEstimate", "build_tables"]
