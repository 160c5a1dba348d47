"""Intra-layer planning: per layer class and tensor-parallel degree, the placement of every
node, chosen by a CP-SAT ILP over DTensor's sharding strategies (see `api.solve_layer`)."""

from autopar.solve.intra.api import IntraLayerCache, layer_problem, solve_layer
from autopar.solve.intra.options import IntraOptions
from autopar.solve.intra.plan import IntraLayerPlan, PlannedCollective

__all__ = [
    "IntraLayerCache",
    "IntraLayerPlan",
    "IntraOptions",
    "PlannedCollective",
    "layer_problem",
    "solve_layer",
]
