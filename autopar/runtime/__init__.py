"""autopar's runtime: what a generated program imports to run a plan under torchrun.

Modules (each documents its public functions at its top):
    mesh             torchrun environment + ParallelConfig -> DeviceMesh (pp, dp, fsdp, cp, tp)
    tensor_parallel  the plan's placements -> a TP/SP plan -> DTensor parallelize_module
    data_parallel    replicated DP (explicit all-reduce), FSDP2 by ZeRO stage, HSDP
    recompute        full / selective activation checkpointing per block
    task             model factory, loss and data (synthetic or a user hook) of a plan
    data             a tokenized file, memory-mapped and read by step (--tokens)
    metrics          the per-step JSON log (and TensorBoard) beside the plan's prediction
    checkpoint       save, verify and resume (torch.distributed.checkpoint); the interval
    capability       what of the above a model admits: bounds the planner's search
    parallelize      a plan applied to a model: pipeline cut, TP, CP, EP, recompute, DP, in order
    trainer          the training loop: AdamW, clipping, accumulation, measured vs predicted
    parts, pipeline, context_parallel, expert_parallel   (pipeline and cp-ep helpers)

Submodules are imported on use, so `import autopar.runtime` stays cheap and free of
torch.distributed side effects.
"""
