"""CostOptions: the knobs of the cost model that are properties of the training stack, not of
the parallel config: which overlaps the framework performs, buffer sizes, reduction dtype, and
how its kernels compare with the ones the hardware profile's efficiencies were fitted to.

A named software stack (`autopar.estimate.stacks`: autopar's own runtime, torchtitan, torch.compile,
Megatron-Core with TransformerEngine, ...) is a sourced set of these values.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from cost_models.comm import DDP_BUCKET_BYTES

if TYPE_CHECKING:
    from autopar.config import ParallelConfig


@dataclass(frozen=True)
class CostOptions:
    # Fraction of tensor-parallel communication hidden behind compute (Megatron-Core's
    # --tp-comm-overlap overlaps GEMMs with their collectives; plain PyTorch TP hides none).
    tp_comm_overlap: float = 0.0
    # The share asynchronous TP (`ParallelConfig.async_tp`) hides where the config asks for
    # it: torchtitan's micro-pipelined TP under torch.compile. 0: the stack cannot run it.
    async_tp_overlap: float = 0.0
    # Gradient reduction overlapped with the backward (DDP buckets, --overlap-grad-reduce).
    overlap_grad_reduce: bool = True
    # With overlap_grad_reduce: the replicated (ZeRO-0) all-reduce overlaps too, as DDP's
    # bucket hooks run it. False: it runs after the last backward, all of it exposed (autopar's
    # runtime: `DataParallel.sync_gradients`, a flat all-reduce in bucket-sized chunks).
    replicated_grad_overlap: bool = True
    # ZeRO-1/2 parameter all-gather overlapped with the next forward (--overlap-param-gather).
    overlap_param_gather: bool = False
    # FSDP prefetches the next layer's parameters while the current one computes.
    fsdp_prefetch: bool = True
    # activation offloading copies on a side stream, beside the next layer's compute
    # (TransformerEngine's CPU offload); False: on the compute stream (torch's save_on_cpu,
    # autopar's runtime), every byte's copy time exposed.
    offload_overlap: bool = False
    # ZeRO-3 gathers each parameter tensor with its own collective (DeepSpeed 2021) instead of
    # one flat collective per layer (FSDP units): each call pays the group's latency.
    fsdp_per_tensor: bool = False
    # ZeRO-3 collectives take a Python list of one view per rank (DeepSpeed 0.3, 2021:
    # torch.distributed.all_gather(partitions, ...) and reduce_scatter(out, input_list)), so
    # torch's ProcessGroupNCCL copies the flat buffer to or from each of the n views: n copy
    # kernels per call (cost_models.compute.per_rank_copies_time_s).
    fsdp_list_copies: bool = False
    # DDP's default bucket (torch.nn.parallel.DistributedDataParallel bucket_cap_mb=25), the
    # chunk autopar's runtime sums flat gradients in
    ddp_bucket_bytes: float = DDP_BUCKET_BYTES
    # Compute time lost per second of communication hidden behind it: NCCL's kernels occupy
    # SMs and HBM bandwidth while they overlap a GEMM, and a GEMM sized to one wave of SMs
    # spills into a second (Lee et al. 2025, arXiv 2507.03114: 18.9% average, 40% worst
    # compute slowdown under overlap on A100/H100). 0 prices hidden communication as free.
    comm_interference: float = 0.0
    # FSDP / the distributed optimizer shard over the data and context-parallel ranks together
    # (torchtitan's dp_shard_cp mesh, Megatron's data-parallel-with-cp group): the model state
    # is split fsdp x cp ways and the context-parallel gradient sum is part of the
    # reduce-scatter; False: over fsdp only, with an all-reduce over cp (autopar's runtime).
    fsdp_over_cp: bool = False
    # Under pipeline parallelism with ZeRO-3, each stage keeps its gathered parameters from
    # the first micro-batch's forward to the last one's backward and accumulates unsharded
    # gradients in the reduce dtype (`grad_bytes`), reduce-scattering once at the end of the
    # step: torchtitan (reshard_after_forward=False under PP, parallelisms/parallelize_llama.py
    # apply_fsdp) and autopar's runtime (`runtime.data_parallel`), both on
    # torch.distributed.pipelining, whose stage backward turns FSDP2's gradient sync and
    # reshard-after-backward off until the last micro-batch. One gather and one reduce-scatter
    # per step; False: both per micro-batch, two layers gathered at a time.
    pp_keeps_unsharded: bool = False
    # A pipeline rank waits for its own send to land before it runs its next micro-batch
    # (Megatron's non-interleaved 1F1B: send_forward_recv_backward and its mirror wait on
    # their requests; DeepSpeed's pipeline engine sends synchronously), so each forward but
    # the last stage's and each backward but the first stage's hold the rank for one hop;
    # False: the send runs beside the next task and only delays its receiver (PyTorch's
    # pipelining schedules post isend and wait at the step's end). Priced for schedules of
    # one model chunk per rank (`StageTimer.pipeline`); interleaved ones overlap their sends.
    pipeline_blocking_sends: bool = False
    # Host time of the gradient hook DeepSpeed's ZeRO-2 and ZeRO-3 run per parameter tensor per
    # micro-batch (the gradient copied into its reduction bucket); 0 where sharding works per
    # layer without per-tensor hooks (FSDP, DDP buckets).
    param_hook_s: float = 0.0
    # Host time of one of the four gather and release hooks ZeRO-3 runs per parameter tensor
    # per micro-batch (gathered and released around the forward, and again around the
    # backward): a separate value from the gradient hook's, as the two do different work.
    param_fetch_hook_s: float = 0.0
    # ZeRO-3 gathers a low-precision recipe's linear weights already cast to FP8 (torchao's
    # enable_fsdp_float8_all_gather, per-tensor scales only), halving their traffic.
    fp8_all_gather: bool = False
    # Bytes per gradient element in data-parallel reductions: fp32 main gradients (Megatron's
    # default accumulation and FSDP2's reduce dtype in mixed precision recipes).
    grad_bytes: int = 4
    # Bytes per element of each of the optimizer's moments (Adam's two, momentum's one): 4,
    # fp32; 2 where the stack keeps them in BF16 (Megatron-Core's use_precision_aware_optimizer
    # with exp_avg_dtype and exp_avg_sq_dtype bf16); 1, an 8-bit optimizer's. The master
    # weights stay fp32. Shrinks the optimizer state and the step's traffic.
    moment_bytes: int = 4
    # Under recompute "none", multi-latent attention's up-projections, rotary and q/k/v
    # concatenations are re-run before the attention's backward instead of their outputs kept
    # (Megatron-Core's recompute_modules "mla_up_proj", `autopar.estimate.kernel_savings`):
    # the activations drop the attention's q, k and v; the backward re-runs the up-projection
    # GEMMs. No effect on a model without MLA. autopar's runtime does not do this: for pricing
    # a stack that does.
    recompute_up_projections: bool = False
    # The stack's RMSNorm and gated activation are fused kernels (TransformerEngine's RMSNorm,
    # Megatron-Core's bias-SwiGLU), which keep fewer tensors for the backward than the eager
    # ops the trace shows: the normalised value and silu(gate) are not kept
    # (`autopar.estimate.kernel_savings`).
    fused_kernel_activations: bool = False
    # Pipeline stage boundaries: False splits the repeated layers evenly (Megatron, torchtitan
    # defaults: what evaluate() of a published config should price); True moves them so the
    # slowest model chunk is as fast as possible (embedding and head work counted).
    balance_stages: bool = False
    # Allocator reserve as a fraction of live memory (cost_models.memory).
    reserve_fraction: float = 0.05
    # The stack's kernels against the ones the profile's efficiency curves describe: the
    # achievable fraction of peak of matmuls and of attention (forward and backward) is scaled
    # by these (capped at 1); the memory-bound ops move `memory_traffic` times the bytes the
    # trace shows (fusion of norms, rotary, activations and residual adds moves fewer).
    matmul_efficiency: float = 1.0
    attention_efficiency: float = 1.0
    memory_traffic: float = 1.0
    # A low-precision recipe's scaling and casts move `cast_traffic` times the bytes of one
    # fused amax-cast(-transpose) kernel per operand (TransformerEngine's, or torch.compile's
    # of torchao's); eager torchao runs the amax and the cast as separate kernels.
    cast_traffic: float = 1.0
    # Host seconds per GEMM of a linear in a low-precision recipe where the stack dispatches
    # the recipe's scaling op by op from Python (torchao's float8 training tensors in eager
    # mode: amax, scale, cast and transposes as separate ops around each GEMM). The device
    # waits where its own work is shorter, so a layer's forward takes at least this per
    # converted linear and its backward twice that; 0 where a compiler or fused kernels make
    # the scaling a few launches (TransformerEngine, torch.compile).
    recipe_host_s: float = 0.0
    # The optimizer step runs as fused multi-tensor kernels (apex's and TransformerEngine's
    # FusedAdam, torch's fused=True), each moment and weight read and written once; False:
    # each op of it is a kernel of its own over each tensor (torch's for-loop and foreach
    # paths, transformers' and Composer's AdamW), and a mixed-precision wrapper over
    # low-precision gradients (`grad_bytes` 2) casts in passes of its own
    # (`autopar.estimate.memory.optimizer_step_bytes`).
    optimizer_fused: bool = True
    # Which of a recipe's blocks' linears run in it: True, those torchao converts (an
    # nn.Linear whose dimensions its GEMMs take, bias-free for MXFP8: autopar's runtime,
    # torchtitan), the rest priced in the base precision; False, every linear
    # (TransformerEngine's modules).
    torchao_linears: bool = False
    # Saved activations as a multiple of what the trace's tensors saved for backward say
    # (a compiler that recomputes cheap pointwise ops in the backward saves fewer).
    activation_factor: float = 1.0
    # Logit-sized tensors live at the loss's peak, in logits of the training precision: 2 is
    # the logits and their gradient; a loss that upcasts to fp32 and keeps its log-softmax
    # holds more, a fused or vocabulary-parallel one fewer.
    logit_copies: float = 2.0
    # Logit-sized fp32 tensors beside those at the loss's peak: a loss that upcasts the logits
    # (`.float()`, as the zoo's and transformers' do) keeps its fp32 log-softmax for backward,
    # and its backward makes the NLL's gradient and the log-softmax's, all fp32; 3 for such a
    # loss whatever the training precision (measured: benchmarks/gpu_program.py).
    logit_fp32_copies: float = 0.0
    # fp32 logit-sized tensors the loss holds beyond those where it runs under torch's
    # `loss_parallel()` (a head whose logits are split over the vocabulary, tp > 1): its
    # log-softmax is decomposed (shift, exp, sum) and its backward makes a zeros tensor, the
    # exp of the log-probabilities, their sum and the product beside the kept log-probabilities,
    # 4 fp32 tensors where the fused kernels' path holds 3 (measured by the allocator's events:
    # tests/autopar/estimate/test_loss_peak.py); 0 for a stack with a loss of its own
    # (Megatron's vocabulary-parallel cross-entropy).
    loss_parallel_fp32_copies: float = 0.0
    # The stack frees the gradients after each optimizer step (torch's
    # `zero_grad(set_to_none=True)`, its default: autopar's runtime), so a step's first
    # micro-batch runs its loss before any gradient is made, and a step of one micro-batch
    # holds none at the loss's peak; False: they live in buffers over the run (Megatron's
    # contiguous gradient buffer, DeepSpeed's), or no peak of the stack's was measured so
    # (torchtitan frees them too, but its published FP8 peaks sit over the plan already:
    # `loss_apart_from_recompute`).
    grads_freed_each_step: bool = False
    # The loss's peak and a recomputed block's activations are priced as two moments, never
    # live together (`memory.StagePhases`: the loss's tensors are freed before any block's
    # backward; autopar's runtime, measured by an H100's allocator history); False: summed,
    # as for a stack whose peak is not measured so (torchtitan's: its published FP8 peak of
    # Llama 3 70B at TP8 x FSDP32 measured 71.9 GiB, priced 64.7 summed and 55.2 as two
    # moments; something else is live there, and the sum is the nearer stand-in).
    loss_apart_from_recompute: bool = False
    # Bytes per parameter autocast holds in mixed precision where the parameters stay fp32 and
    # no FSDP2 unit gathers them in bf16 (fsdp == 1): a bf16 copy of each matmul weight, made
    # per forward and saved for its backward (layers recomputed whole save none); a pipeline's
    # one autocast region over the step keeps one copy of all of its weights.
    autocast_weight_bytes: float = 0.0
    # The token embedding and the LM head split over the vocabulary under tp > 1 with context
    # parallelism too (Megatron, torchtitan); False: autopar's runtime, whose context-parallel
    # loss reads whole-vocabulary logits, keeps both whole on every tp rank with cp > 1.
    vocab_parallel_with_cp: bool = True
    # With sequence parallelism a pipeline stage sends its sequence shard (Megatron,
    # torchtitan); False: each model chunk gathers the sequence at its last block and splits it
    # at its first (autopar's runtime: a TP plan per chunk), so the whole sequence is sent and
    # each chunk costs an all-gather over tp each way per micro-batch.
    pipeline_sends_sequence_shards: bool = True
    # With sequence parallelism, the column-parallel projections keep for their weight
    # gradient the input SP's all-gather made, the whole sequence (torch's DTensor styles,
    # autopar's runtime); False: they keep the rank's sequence shard and gather it again in
    # the backward (Megatron-Core), so that input divides by tp like the other replicated ones.
    sequence_parallel_saves_gathered: bool = False
    # Mixture of experts under ep > 1: the busiest ep rank's routed rows over the mean (1.0:
    # tokens spread evenly, as a force-balanced or capacity-limited router keeps them; a
    # learned router's skew is above 1). That rank's expert matmuls, saved rows and
    # all-to-all bytes are priced, since every ep rank waits for it at the combine.
    moe_imbalance: float = 1.0
    # The stack these values describe (`autopar.estimate.stacks`), recorded in the plan; ""
    # for values of one's own, whose kernel factors then scale the profile's curves directly.
    stack: str = ""

    def __post_init__(self) -> None:
        for name in ("tp_comm_overlap", "async_tp_overlap"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")
        for name in ("param_hook_s", "param_fetch_hook_s", "recipe_host_s"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        if not 0.0 <= self.comm_interference <= 1.0:
            raise ValueError(f"comm_interference must be in [0, 1], got {self.comm_interference}")
        if self.grad_bytes not in (2, 4):
            raise ValueError(f"grad_bytes must be 2 or 4, got {self.grad_bytes}")
        if self.moment_bytes not in (1, 2, 4):
            raise ValueError(f"moment_bytes must be 1, 2 or 4, got {self.moment_bytes}")
        for name in ("matmul_efficiency", "attention_efficiency", "memory_traffic",
                     "cast_traffic", "activation_factor"):  # fmt: skip
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
        if not (math.isfinite(self.moe_imbalance) and 1.0 <= self.moe_imbalance <= 1024):
            # the busiest of ep ranks receives at most every row: ep times the mean, and no
            # expert-parallel degree is above 1,024
            raise ValueError(
                f"moe_imbalance must be a finite number in [1, 1024] (the busiest ep rank's "
                f"routed rows over the mean, at most ep), got {self.moe_imbalance}"
            )
        for name in (
            "logit_copies", "logit_fp32_copies", "loss_parallel_fp32_copies",
            "autocast_weight_bytes",
        ):  # fmt: skip
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")


def stack_problems(cfg: ParallelConfig, options: CostOptions) -> list[str]:
    """What in ``cfg`` the stack of ``options`` cannot run, each naming the stacks that can."""
    out = []
    where = f"the {options.stack} stack" if options.stack else "these cost options"
    if cfg.async_tp and not options.async_tp_overlap:
        out.append(
            f"async_tp: {where} does not overlap TP matmuls with their "
            "collectives (its async_tp_overlap is 0); torchtitan-compile (enable_async_tensor_"
            "parallel) and Megatron-Core (--tp-comm-overlap) do"
        )
    if cfg.zero_stage and cfg.fsdp == 1 and not options.fsdp_over_cp:
        out.append(
            f"zero_stage={cfg.zero_stage} with fsdp=1 shards over the cp={cfg.cp} ranks, which "
            f"{where} does not do (its fsdp_over_cp is false: it shards over "
            "fsdp and sums gradients over cp); torchtitan and Megatron-Core do, or use fsdp > 1"
        )
    return out
