"""Torch-free cost models: pure functions from numbers to seconds and bytes.

Modules:
    compute   roofline time of one op from FLOPs and bytes, with size-dependent efficiency
    comm      collectives on a group of ranks placed on a hierarchical or torus topology
    memory    model state, activations, in-flight micro-batches, allocator reserve
    pipeline  event simulation of pipeline schedules (GPipe, 1F1B, interleaved, ZB, DualPipe-V)
    goodput   useful time over wall time under failures and checkpoints (Daly), the interval

Nothing here imports torch, so the cost model can be used (and tested) without it.
"""
