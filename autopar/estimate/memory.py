"""What a rank holds: parameters per layer and stage, and each stage's peak memory.

In: the model's `ModelTables`, a `ParallelConfig`, the training precision and optimizer, and
the `CostOptions`. Out: parameter counts on one rank and a stage's `PeakMemory`
(`cost_models.memory`), the memory the search prunes by.

Parameters of layers L on a rank, before data-parallel sharding:
    P(L) = sum_l (params_tp_l / tp + params_rep_l)              `dense_params_on_rank`
           + sum_l params_expert_l / (ep etp)                   `expert_params_on_rank`
A stage holding the head of a tied embedding without the embedding holds its own copy of the
tied weight, T / tp elements (`tied_elements`; autopar.runtime.pipeline: the last stage's copy,
its gradients summed with the first stage's after the backward): `StageMemory.stage_params`.

Peak memory of a stage (`StageMemory.stage_phases(...).peak()`):
    model state   parameters, gradients, optimizer state by ZeRO stage over fsdp ranks (fsdp x
                  cp where the stack shards over the context-parallel ranks too); with ep > 1
                  under ZeRO the experts over the dp x fsdp x cp / ep ranks holding the
                  same ones (`expert_shard_ways`) (`cost_models.memory.model_state_bytes`)
    activations   a_l under the layer's recompute policy, per micro-batch, times the
                  micro-batches in flight n (an offloaded block's, `offload_layers`, wait in
                  host memory instead: two of the largest such on the device, one going out
                  and one coming back, under buffers); where autocast computes over fp32 parameters
                  (no ZeRO, mixed precision), its bf16 weight copies,
                  `autocast_weight_bytes` per parameter of the layers not recomputed whole
                  (all of a pipeline stage's: one region over the step); saved activations
                  scaled by the stack's `activation_factor`; an eager norm's fp32 upcast
                  at fp32's width (`kernel_savings.norm_upcasts`). Beside these, the larger
                  of two moments (`StagePhases`), never live together where the stack's
                  `loss_apart_from_recompute` is set (else summed): the loss's peak at the
                  start of the backward, `CostOptions.logit_copies` logit-sized tensors on
                  the last stage (2: the logits and their gradient) and `logit_fp32_copies`
                  fp32 ones (a loss that upcasts; under torch's loss_parallel,
                  vocabulary-split logits, `loss_parallel_fp32_copies` more), all freed
                  before any block's backward; and a block's backward, the largest
                  a_l^none - a_l^policy (one layer recomputed at a time). Where the stack
                  frees the gradients each step (`grads_freed_each_step`) and a step runs one
                  micro-batch, no gradient exists yet at the loss's peak
    buffers       ZeRO-3: twice the largest layer's parameters and gradients (the gathered
                  layer and the prefetched next), or under pp > 1 where the stack keeps them
                  over the step (`CostOptions.pp_keeps_unsharded`) all of the stage's; else
                  two DDP buckets where there is data parallelism (dp x fsdp > 1, or ZeRO), none
                  without
    reserve       the allocator's share (`cost_models.memory.allocator_reserve_bytes`), at
                  least the stage's largest tensor (the loss's logit-sized one): fragmented
                  free bytes do not serve a request that large
Activations per shard class (`StageMemory.activation_bytes`, `shard_divisors`): "tp" divided by
tp * cp, "rep" and "expert" by cp (and by tp with sequence parallelism; experts are whole on
every tp rank, each on its own tokens; "expert" by tp * cp where etp = tp); with
cp > 1 the backward keeps the whole sequence's K and V (context parallelism all-gathers them).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from autopar.config import ParallelConfig
from autopar.estimate.as_run import routed_layer
from autopar.estimate.module_regions import regions_named
from autopar.estimate.options import CostOptions
from autopar.estimate.saved_split import MODULES, module_kinds, module_policy
from autopar.estimate.tables import LayerTable, ModelTables
from cost_models.memory import (
    DEFAULT_RESERVE_MINIMUM_BYTES,
    MASTER_WEIGHT_BYTES,
    MOMENTS,
    ModelStateBytes,
    PeakMemory,
    model_state_bytes,
    peak_memory,
)

# Bytes per element of the training precision.
PRECISION_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
# Bytes read + written per parameter by one optimizer step (fp32 master weights, fp32 grads),
# keyed by (optimizer, mixed precision). AdamW mixed precision: read master, m, v, grad (16),
# write master, m, v (12), bf16 copy (2).
OPTIMIZER_BYTES = {
    ("adamw", True): 30,
    ("adamw", False): 28,
    ("adam", True): 30,
    ("adam", False): 28,
    ("sgd_momentum", True): 22,
    ("sgd_momentum", False): 20,
    ("sgd", True): 14,
    ("sgd", False): 12,
}


# The same step where each op is a kernel of its own over each tensor (torch's for-loop and
# foreach optimizers, transformers' and Composer's AdamW: `CostOptions.optimizer_fused` False),
# fp32 parameters and gradients, counted op by op from torch.optim.adamw._single_tensor_adamw:
# p.mul_ (decay) 8, m.lerp_(g) 12, v.mul_ 8, v.addcmul_(g, g) 12, v.sqrt() 8, / 8, .add_(eps)
# 8, p.addcdiv_(m, denom) 16; Adam the same without the decay (torch's default
# weight_decay 0); SGD with momentum (no decay, torch's default): buf.mul_ 8, buf.add_(g) 12,
# p.add_(buf) 12; plain SGD: p.add_(g) 12.
UNFUSED_OPTIMIZER_BYTES = {"adamw": 80, "adam": 72, "sgd_momentum": 32, "sgd": 12}
# An unfused mixed-precision wrapper over low-precision model weights and gradients
# (DeepSpeed's FP16_UnfusedOptimizer and ZeRO's partitions, apex O2) casts in passes of its
# own: the gradient to an fp32 copy (read 2, write 4) and the updated master back (read 4,
# write 2). None where the gradients reach the step in fp32 over fp32 parameters (FSDP's
# mixed precision, autocast).
UNFUSED_CAST_BYTES = 12
# fp16's loss scaling checks the gradients for inf/nan and unscales them before the step:
# fused, one pass (torch's _amp_foreach_non_finite_check_and_unscale_, apex's
# multi_tensor_scale: read 4, write 4); unfused, DeepSpeed's per-tensor check, a sum of the
# upcast gradient (read 2, write 4, read 4, deepspeed/runtime/utils.py CheckOverflow), then
# the unscale (read 4, write 4).
LOSS_SCALE_BYTES = {True: 8, False: 18}


def optimizer_step_bytes(
    optimizer: str, precision: str, moment_bytes: int, fused: bool = True, grad_bytes: int = 4
) -> int:
    """Bytes per parameter one optimizer step reads and writes: `OPTIMIZER_BYTES` or, not
    ``fused``, `UNFUSED_OPTIMIZER_BYTES` plus `UNFUSED_CAST_BYTES` in mixed precision with
    low-precision gradients (``grad_bytes`` 2) (each moment read and written at 4 bytes),
    with the moments (`cost_models.memory.MOMENTS`) at ``moment_bytes`` each
    (`CostOptions.moment_bytes`), plus fp16's `LOSS_SCALE_BYTES`."""
    mixed = precision != "fp32"
    if fused:
        step = OPTIMIZER_BYTES[(optimizer, mixed)]
    else:
        casts = UNFUSED_CAST_BYTES if mixed and grad_bytes < 4 else 0
        step = UNFUSED_OPTIMIZER_BYTES[optimizer] + casts
    scale = LOSS_SCALE_BYTES[fused] if precision == "fp16" else 0
    return step + scale - 2 * MOMENTS[optimizer] * (4 - moment_bytes)


def dense_params_on_rank(cfg: ParallelConfig, layers: list[LayerTable]) -> float:
    """The tensor-parallel and replicated parameters of ``layers`` on a rank (no experts)."""
    return sum(t.params_tp / cfg.tp + t.params_rep for t in layers)


def expert_params_on_rank(cfg: ParallelConfig, layers: list[LayerTable]) -> float:
    """The expert parameters of ``layers`` on a rank: split over ep, and over tp where etp = tp,
    else whole on every tp rank (`layer_cost` module docstring)."""
    return sum(t.params_expert for t in layers) / (cfg.ep * cfg.etp)


def shared_out_experts(cfg: ParallelConfig, layers: list[LayerTable]) -> float:
    """The expert parameters of ``layers`` a rank holds as ep's share (synced and sharded on
    their own); 0 with ep = 1, where experts are parameters like any other."""
    return expert_params_on_rank(cfg, layers) if cfg.ep > 1 else 0.0


def params_on_rank(cfg: ParallelConfig, layers: list[LayerTable]) -> float:
    """Parameters a rank holds of ``layers`` before data-parallel sharding (TP and EP split)."""
    return dense_params_on_rank(cfg, layers) + expert_params_on_rank(cfg, layers)


def token_ways(cfg: ParallelConfig) -> int:
    """The ranks one sample's tokens are split over for per-token work: cp, and tp with
    sequence parallelism (norms, routers and experts then run on sequence shards)."""
    return cfg.cp * (cfg.tp if cfg.sequence_parallel else 1)


def shard_divisors(cfg: ParallelConfig, gathered_whole: bool = False) -> dict[str, int]:
    """Per shard class, what divides a layer's per-sample work and activations on one rank:
    "tp" by tp x cp; "rep" (norms, routers) by `token_ways`; "expert" by `token_ways`
    (experts run whole on every tp rank, each on its own tokens), or by tp x cp where etp = tp
    (each rank its slice of every expert, on all the tp group's tokens); "whole" (an unsplit
    vocabulary layer) by cp;
    "gathered" (a column-parallel projection's saved input) as "rep", or by cp where SP's
    all-gather output is what is kept (``gathered_whole``:
    `CostOptions.sequence_parallel_saves_gathered`); "routed" (a dispatch's hidden-wide rows,
    `as_run.routed_layer`) as "expert", or by cp where etp = tp (the tp group's tokens)."""
    ways = token_ways(cfg)
    gathered = cfg.cp if gathered_whole and cfg.sequence_parallel else ways
    split = cfg.etp > 1
    return {"tp": cfg.tp * cfg.cp, "rep": ways, "expert": cfg.tp * cfg.cp if split else ways,
            "whole": cfg.cp, "gathered": gathered,
            "routed": cfg.cp if split else ways}  # fmt: skip


def token_summed_params(cfg: ParallelConfig, layers: list[LayerTable]) -> float:
    """With sequence parallelism, the routers' and this rank's experts' parameters of
    ``layers``: whole weights that saw the rank's sequence shard, their gradients summed over
    tp after the backward (`autopar.runtime.tp_apply`, "token_sum"); as sharded on the rank
    (the experts over their replicas where ep and fsdp shard them, else over fsdp; not the
    experts where etp = tp: each tp rank holds its own slice, nor where ep folds over tp)."""
    if not (cfg.sequence_parallel and cfg.tp > 1):
        return 0.0
    fsdp = cfg.fsdp if cfg.fsdp > 1 and cfg.zero_stage >= 1 else 1
    # folded over the tp ranks, each holds other experts: nothing of theirs to sum over tp
    whole = cfg.etp == 1 and not cfg.ep_folds_over_tp
    experts = expert_params_on_rank(cfg, layers) if whole else 0.0
    ways = expert_shard_ways(cfg) if cfg.ep > 1 else fsdp
    return sum(t.params_router for t in layers) / fsdp + experts / ways


def expert_replicas(cfg: ParallelConfig) -> int:
    """Ranks holding the same experts: the dp x fsdp x cp token ranks ep folds over (x tp
    where it folds over the tp ranks too, `ParallelConfig.ep_folds_over_tp`), divided by ep
    (`autopar.runtime.expert_parallel`)."""
    tp = cfg.tp if cfg.ep_folds_over_tp else 1
    return cfg.dp * cfg.fsdp * cfg.cp * tp // cfg.ep


def expert_shard_ways(cfg: ParallelConfig) -> int:
    """How many ways ZeRO splits the experts' state: under ZeRO each MoE layer's experts are
    an FSDP2 unit over their replicas; without, or where ep spans every data rank (FSDP leaves
    them out), not at all."""
    return expert_replicas(cfg) if cfg.zero_stage else 1


def tied_elements(tables: ModelTables) -> float:
    """Elements of the head's weight that another layer (the embedding) holds: the head's
    matmul weights beyond its own parameters (the tracer counts a tied weight once, on the
    first layer that reads it)."""
    heads = [t for t in tables.layers if t.vocab_logits_bytes]
    if not heads or not tables.traced_float_bytes:
        return 0.0
    head = heads[-1]
    weights = sum(mm.weight_bytes for mm in head.matmuls) / tables.traced_float_bytes
    return max(0.0, weights - head.params_tp - head.params_rep)


def vocab_whole(cfg: ParallelConfig, options: CostOptions) -> bool:
    """Whether ``cfg`` runs the token embedding and the LM head whole on every tp rank: tp > 1
    and cp > 1 where the stack splits the vocabulary only without context parallelism
    (`CostOptions.vocab_parallel_with_cp`, `as_run.whole_vocabulary`)."""
    return cfg.tp > 1 and cfg.cp > 1 and not options.vocab_parallel_with_cp


def sequence_ends_gathered(cfg: ParallelConfig, tables: ModelTables, options: CostOptions) -> bool:
    """With SP, whether the stack splits the sequence at each model chunk's first block and
    gathers it after its last (autopar's runtime, `CostOptions.pipeline_sends_sequence_shards`
    false: every pipeline chunk, and a whole model without Megatron's ends,
    `ModelTables.split_sequence_ends`), so the final norm and the head's input run whole."""
    if not (cfg.sequence_parallel and cfg.tp > 1) or options.pipeline_sends_sequence_shards:
        return False
    return cfg.pp > 1 or tables.split_sequence_ends


def stage_kept_gathered(cfg: ParallelConfig, options: CostOptions) -> bool:
    """Whether FSDP's units stay gathered, their gradients unsharded, over a pipeline's step
    (`CostOptions.pp_keeps_unsharded`, pp > 1, ZeRO)."""
    return options.pp_keeps_unsharded and cfg.pp > 1 and cfg.zero_stage >= 1


def dispatched(cfg: ParallelConfig, table: LayerTable, imbalance: float = 1.0) -> LayerTable:
    """The layer as the runtime runs it under ``cfg``: with ep > 1 the all-to-all dispatch
    runs each token on its top k experts only (`as_run.routed_layer`); without, a
    dense-dispatch MoE runs every expert on every token, as traced. ``imbalance``: the busiest
    ep rank's routed rows over the mean (`CostOptions.moe_imbalance`)."""
    return routed_layer(table, imbalance) if cfg.ep > 1 else table


class StageMemory:
    """Parameters and peak memory per stage of one model (module docstring); caches the
    activation bytes per layer, policy and shape."""

    def __init__(
        self,
        tables: ModelTables,
        *,
        precision: str,
        optimizer: str,
        options: CostOptions,
        act_scale: float,
    ) -> None:
        self.tables = tables
        self.precision = precision
        self.optimizer = optimizer
        self.options = options
        self.act_scale = act_scale
        self.tied = tied_elements(tables)  # a tied embedding's elements (0: none)
        self._experts = any(t.params_expert for t in tables.layers)
        self._activation_cache: dict[tuple, float] = {}
        self._layer_params: dict[tuple, float] = {}
        # `_stage_parts` per (config, stage signature): a deep pipeline's stages repeat
        self._stage_cache: dict[
            tuple, tuple[ModelStateBytes, float, float, float, float, float]
        ] = {}

    def params(self, cfg: ParallelConfig, layers: list[LayerTable]) -> float:
        """`params_on_rank`, skipping the expert sum for a dense model (the search's hot path:
        one layer's figure is cached per tp and ep)."""
        if len(layers) == 1:
            key = (layers[0].name, cfg.tp, cfg.ep, cfg.etp)
            got = self._layer_params.get(key)
            if got is None:
                got = self._layer_params[key] = self._params(cfg, layers)
            return got
        return self._params(cfg, layers)

    def _params(self, cfg: ParallelConfig, layers: list[LayerTable]) -> float:
        dense = dense_params_on_rank(cfg, layers)
        return dense + expert_params_on_rank(cfg, layers) if self._experts else dense

    def stage_params(self, cfg: ParallelConfig, layers: list[LayerTable]) -> float:
        """Parameters of a stage's ``layers`` on one rank, with the tied copy (docstring)."""
        return self.params(cfg, layers) + self.tied_copy(cfg, layers)

    def tied_copy(self, cfg: ParallelConfig, layers: list[LayerTable]) -> float:
        """The tied weight's elements on a rank of the stage holding ``layers``: a copy where
        the stage has the head but not the first layer (where the tracer counts it)."""
        first = self.tables.layers[0].name
        if not self.tied or any(t.name == first for t in layers):
            return 0.0
        heads = [t for t in layers if t.vocab_logits_bytes]
        return self.tied / (cfg.tp if heads[0].vocab_split else 1) if heads else 0.0

    def shard_ways(self, cfg: ParallelConfig) -> int:
        """How many ways ZeRO splits the model state: fsdp, or fsdp x cp where the stack
        shards over the context-parallel ranks too (`CostOptions.fsdp_over_cp`)."""
        return cfg.fsdp * (cfg.cp if self.options.fsdp_over_cp else 1)

    def model_state(self, cfg: ParallelConfig, layers: list[LayerTable]) -> ModelStateBytes:
        """Parameters, gradients and optimizer state of a stage's ``layers`` on one rank: the
        dense ones sharded `shard_ways`, the experts `expert_shard_ways`."""
        dense, experts = self._split(cfg, layers)

        def state(n: float, ways: int) -> ModelStateBytes:
            return model_state_bytes(
                n,
                precision=self.precision,  # type: ignore[arg-type]
                optimizer=self.optimizer,  # type: ignore[arg-type]
                zero_stage=cfg.zero_stage,
                shard_degree=ways,
                moment_bytes=self.options.moment_bytes,
            )

        rest = state(dense, self.shard_ways(cfg))
        if experts:
            expert = state(experts, expert_shard_ways(cfg))
            rest = ModelStateBytes(
                rest.parameters_bytes + expert.parameters_bytes,
                rest.gradients_bytes + expert.gradients_bytes,
                rest.optimizer_bytes + expert.optimizer_bytes,
            )
        fp32_params = self.options.autocast_weight_bytes and self.precision != "fp32"
        if fp32_params and cfg.zero_stage in (0, 3):
            # a stack whose parameters stay fp32 under autocast (autopar's runtime, FSDP2's
            # sharded ones too) holds fp32 parameters and gradients and no master copy: the
            # same total where every term is sharded alike (ZeRO-0, ZeRO-3), split as it runs
            # (the trainer's measured parameters, gradients and optimizer state), so the
            # gradients a step has not made yet are the bytes they take
            wider = MASTER_WEIGHT_BYTES / PRECISION_BYTES[self.precision]
            rest = ModelStateBytes(
                rest.parameters_bytes * wider,
                rest.gradients_bytes * wider,
                rest.optimizer_bytes - rest.parameters_bytes * wider,  # less the master copy
            )
        return rest

    def sharded_params(self, cfg: ParallelConfig, layers: list[LayerTable]) -> float:
        """Parameters of a stage's ``layers`` whose optimizer state this rank steps (ZeRO >= 1:
        its shards; the experts' over `expert_shard_ways`)."""
        if cfg.zero_stage == 0:
            return self.stage_params(cfg, layers)
        dense, experts = self._split(cfg, layers)
        return dense / self.shard_ways(cfg) + experts / expert_shard_ways(cfg)

    def _split(self, cfg: ParallelConfig, layers: list[LayerTable]) -> tuple[float, float]:
        """A stage's parameters on a rank: (the rest, the experts ep shares out)."""
        experts = shared_out_experts(cfg, layers) if self._experts else 0.0
        return self.stage_params(cfg, layers) - experts, experts

    def stage_phases(
        self,
        cfg: ParallelConfig,
        layers: list[LayerTable],
        inflight: float,
        recomputed: frozenset[str] | None = None,
        microbatches: int | None = None,
        offloaded: frozenset[str] = frozenset(),
    ) -> StagePhases:
        """A stage holding ``layers`` with ``inflight`` micro-batches of activations, at the
        loss's peak and at a block's backward (its peak memory: ``.peak()``); ``recomputed``
        names the layers the recompute policy applies to (None: all); ``microbatches`` a step
        runs (None: several); ``offloaded`` the blocks whose saved activations wait in host
        memory (`stages.offloaded_layers`)."""
        state, per_mb, transient, logits, fp32_copies, buffers, copies = self._stage_parts(
            cfg, layers, recomputed, offloaded
        )
        o = self.options
        one_fp32 = logits / PRECISION_BYTES[self.precision] * 4  # one logit-sized fp32 tensor
        return StagePhases(
            state=state,
            kept=per_mb * max(1.0, inflight) + copies,
            loss=logits * o.logit_copies + one_fp32 * fp32_copies,
            transient=transient,
            buffers=buffers,
            grads_unmade=microbatches == 1 and o.grads_freed_each_step,
            apart=o.loss_apart_from_recompute,
            # the allocator must find the loss's largest tensor whole: free bytes split over
            # partly used segments do not serve it (an H100 run asked for a 7.83 GiB fp32
            # logits tensor with 4.95 GiB reserved but unallocated, and ran out of memory 2 GiB
            # below the plan's live bytes: data/measurements/h100_program_2026-11-26.json)
            largest=one_fp32 if o.logit_fp32_copies else logits,
            reserve_fraction=o.reserve_fraction,
        )

    def _stage_parts(
        self,
        cfg: ParallelConfig,
        layers: list[LayerTable],
        recomputed: frozenset[str] | None,
        offloaded: frozenset[str] = frozenset(),
    ) -> tuple[ModelStateBytes, float, float, float, float, float, float]:
        """(model state, activations per micro-batch, the largest recompute transient, logit
        bytes, the fp32 logit-sized tensors at the loss, communication buffers, autocast's
        weight copies) of a stage, cached by what
        they read of each layer: its class (a block; else the layer itself), whether it is
        the model's first (a tied copy) and whether the policy applies to it."""
        first = self.tables.layers[0].name
        key = (cfg, tuple(
            (t.class_id if t.kind == "block" else t.name, t.name == first,
             recomputed is None or t.name in recomputed, t.name in offloaded)
            for t in layers
        ))  # fmt: skip
        cached = self._stage_cache.get(key)
        if cached is not None:
            return cached
        params = self.stage_params(cfg, layers)
        state = self.model_state(cfg, layers)
        b, t, c = cfg.micro_batch_size, cfg.tp, cfg.cp
        pbytes = PRECISION_BYTES[self.precision]
        per_mb = transient = logits = cast = staged = 0.0
        fp32_copies = self.options.logit_fp32_copies
        # autocast over fp32 parameters: without FSDP2's bf16 gathers, in mixed precision
        casts = (
            not cfg.zero_stage and self.precision != "fp32" and self.options.autocast_weight_bytes
        )
        for table in layers:
            policy = self.policy(cfg, table, recomputed)
            kept, none = (self.activation_bytes(cfg, table, p) for p in (policy, "none"))
            if table.name in offloaded:  # in host memory between its forward and backward
                staged = max(staged, kept)
            else:
                per_mb += kept
            transient = max(transient, none - kept)
            split = t if table.vocab_split else 1  # the logits' vocabulary over tp
            logits += table.vocab_logits_bytes * b / (split * c) * self.act_scale
            if table.vocab_logits_bytes and split > 1:  # the loss runs under loss_parallel()
                fp32_copies += self.options.loss_parallel_fp32_copies
            if casts and (policy != "full" or cfg.pp > 1):
                cast += self._matmul_share(table) * self.params(cfg, [table])
        copies = cast * self.options.autocast_weight_bytes
        if cfg.zero_stage == 3 and stage_kept_gathered(cfg, self.options):
            # the stage's parameters gathered and their gradients unsharded, over the step
            # (gathered in the precision, an upper bound where FSDP gathers a recipe's linears
            # in FP8)
            buffers = params * (pbytes + self.options.grad_bytes)
        elif cfg.zero_stage == 3:
            largest = max((self.params(cfg, [x]) for x in layers), default=0.0)
            buffers = 2 * largest * (pbytes + self.options.grad_bytes)
        elif cfg.dp * cfg.fsdp > 1 or cfg.zero_stage:
            buffers = 2 * min(self.options.ddp_bucket_bytes, params * self.options.grad_bytes)
        else:  # no data parallelism: no gradient buckets
            buffers = 0.0
        # offloading: a block's activations on the device while they are copied out, and the
        # next one's while they are copied back in, at most one of each at a time
        buffers += 2 * staged
        if len(self._stage_cache) > 100_000:  # a long search's: bound the memory it holds
            self._stage_cache.clear()
        parts = (state, per_mb, transient, logits, fp32_copies, buffers, copies)
        cached = self._stage_cache[key] = parts
        return cached

    def policy(
        self, cfg: ParallelConfig, table: LayerTable, recomputed: frozenset[str] | None
    ) -> str:
        """The recompute policy ``table`` runs under: the config's where ``recomputed`` names
        it (None: every layer), else none ("up_proj" where the stack recomputes MLA's
        up-projections without a policy); with ``recompute_modules``, the regions of them the
        layer has (`saved_split.module_policy`, "none" where it has none)."""
        if recomputed is not None and table.name not in recomputed:
            return "none"
        if cfg.recompute_modules:
            up = self.options.recompute_up_projections
            return module_policy(regions_named(table.module_regions, cfg.recompute_modules, up))
        if cfg.recompute == "none" and self.options.recompute_up_projections:
            return "up_proj"
        return cfg.recompute

    def _matmul_share(self, table: LayerTable) -> float:
        """The share of ``table``'s parameters that are matmul weights (autocast casts those,
        not an embedding's table or a norm's scale)."""
        total = table.params_tp + table.params_rep + table.params_expert
        if not total:
            return 0.0
        weights = sum(op.weight_bytes for op in table.matmuls) * self.act_scale
        return min(1.0, weights / PRECISION_BYTES[self.precision] / total)

    def activation_bytes(self, cfg: ParallelConfig, table: LayerTable, policy: str) -> float:
        """One micro-batch's activations ``table`` keeps under ``policy`` on one rank: per
        shard class, divided by t*c (sharded) or c (x t with SP, replicated); cached."""
        b, t, c, sp = cfg.micro_batch_size, cfg.tp, cfg.cp, cfg.sequence_parallel
        key = (table.name, policy, b, t, c, sp, cfg.ep > 1, cfg.pp > 1, cfg.etp)
        if key not in self._activation_cache:
            div = shard_divisors(cfg, self.options.sequence_parallel_saves_gathered)
            if table.kind != "block" and sequence_ends_gathered(cfg, self.tables, self.options):
                div = {**div, "rep": c, "gathered": c}
            imbalance = self.options.moe_imbalance
            splits = dispatched(cfg, table, imbalance).activations
            # "up_proj": "none" less MLA's q, k and v; fused kernels keep less of either
            # (`kernel_savings`)
            parts = [("none" if policy == "up_proj" else policy, 1.0)]
            # a module policy's own parts (`saved_split`): what of its kept values the fused
            # kernels keep otherwise, or keep in fp32
            prefix = policy if policy.startswith(MODULES) else ""
            eager = policy in ("none", "up_proj") or bool(prefix)
            if eager and self.options.fused_kernel_activations:
                parts.append((prefix + "-fused", -1.0))
            elif eager and prefix + "+fp32" in splits:
                # eager norms' fp32 upcasts: their traced bytes at fp32's width, not scaled
                # to the precision (`kernel_savings.norm_upcasts`)
                parts.append((prefix + "+fp32", 1.0 / self.act_scale - 1.0))
            if policy == "up_proj":
                parts.append(("-up_proj", -1.0))
            kept = sum(
                sign * v * b / div[k] for name, sign in parts for k, v in splits[name].items()
            )
            whole_kv = policy in ("none", "up_proj") or (
                bool(prefix) and not any(table.module_regions[k].has_attention
                                         for k in module_kinds(policy) or ())
            )  # fmt: skip
            if c > 1 and whole_kv:
                # context parallelism all-gathers K and V: the backward keeps the whole
                # sequence's, not the 1/c shard counted above (autopar.runtime.context_parallel)
                kept += sum(op.kv_bytes for op in table.attention) * b / t * (1 - 1 / c)
            self._activation_cache[key] = self.act_scale * kept * self.options.activation_factor
        return self._activation_cache[key]


@dataclass(frozen=True)
class StagePhases:
    """A stage's bytes at the two moments its peak can fall on, never live together where
    ``apart`` (the allocator's history of an H100 run, `benchmarks/gpu_memory_snapshot.py`:
    at the peak of a step of one micro-batch of 16 with full recompute, three fp32 logit
    tensors, the parameters, the optimizer state and the blocks' saved inputs, no gradient
    and no recomputed block: data/measurements/h100_program_2026-11-27.json); else the
    block's bytes are priced at the loss's moment too:

    the loss's    at the start of the backward: the loss's logit-sized tensors, the model state
                  less the gradients where none exists yet (`grads_unmade`: the stack frees
                  them each step and a step runs one micro-batch, so the loss's backward runs
                  before any gradient is made)
    a block's     in the blocks' backward, after the loss's tensors are freed: the largest
                  recomputed block's own activations (one at a time), every gradient made
                  backward

    Both hold the activations kept for the micro-batches in flight and the buffers."""

    state: ModelStateBytes
    kept: float
    loss: float
    transient: float
    buffers: float
    grads_unmade: bool
    apart: bool  # False: the block's bytes priced at the loss's moment too (`CostOptions`)
    largest: float
    reserve_fraction: float

    def peak(self, dropped: float = 0.0, transient: float | None = None) -> PeakMemory:
        """The larger moment with its allocator reserve; ``dropped`` kept bytes fewer and
        ``transient`` for the block's (`Estimator.fewest_recomputed_layers`: k blocks
        recomputed)."""
        kept = self.kept - dropped
        at_loss = self.state
        if self.grads_unmade:
            at_loss = replace(self.state, gradients_bytes=0.0)
        block = self.transient if transient is None else transient
        loss = self.loss if self.apart else self.loss + block
        state, activations = at_loss, kept + loss
        if self.state.total_bytes + block > at_loss.total_bytes + loss:
            state, activations = self.state, kept + block
        return peak_memory(
            state,
            activation_bytes=activations,
            communication_buffer_bytes=self.buffers,
            reserve_fraction=self.reserve_fraction,
            reserve_minimum_bytes=max(DEFAULT_RESERVE_MINIMUM_BYTES, self.largest),
        )
