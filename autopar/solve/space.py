"""The search space: every ParallelConfig worth pricing for a model on a cluster.

Degrees: tp divides the devices of a node (tensor parallelism stays inside the fast domain) and
the attention heads; pp divides the world and is at most the number of repeated layers; cp
divides the world and splits the sequence into 2*cp load-balanced chunks; the remaining data-
parallel ranks split into dp x fsdp (fsdp > 1 with ZeRO 1, 2 or 3; both > 1 is HSDP); ep divides
dp x fsdp x cp (the runtime folds it over those ranks, cp first; with fsdp the experts are sharded
over the ranks holding the same ones; not searched with HSDP) and the number of experts. Per
degree choice: sequence parallelism on or off with tp, micro-batch size, schedule (and virtual
stages, and pipeline slots where they make the chunks possible or even: `_slot_choices`) with
pp, recompute policy (and the module sets of `SpaceLimits.recompute_modules` as selective
recompute); asynchronous TP instead of plain with sequence parallelism where the stack
runs it (`SpaceLimits.async_tp`); with cp > 1 both ways attention crosses the shards
(all-gather of K and V, or the ring).
Per recompute policy (full, selective), `recompute_layer_choices` gives the per-layer variants:
the policy on only the first k blocks of each of the pp x v model chunks, k = 1 ..
ceil(num_blocks / (pp x v)) (`blocks_per_chunk`); `inner_choices` yields the all-layer config
(recompute_layers=None) and the search expands it, so the space is inner_choices x those.
Axis orders (`axis_orders`): which non-pipeline axis lies innermost on the ranks (inside the
NVLink domain, the node) and which across; only the axes of degree > 1 move (a degree-1 axis
changes no stride), each distinct order of them once, the default relative order first (as
axis_order=None). The search keeps one order per set of groups on the cluster's levels.
Divisibility is checked here, so every config that comes out is one the runtime can run.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from itertools import permutations, product

from autopar.config import DEFAULT_AXIS_ORDER, SPLIT_BACKWARD, ParallelConfig


@dataclass(frozen=True)
class SpaceLimits:
    """Facts about the model and cluster that bound the space."""

    world_size: int
    devices_per_node: int
    num_blocks: int
    num_heads: int
    seq_len: int
    num_experts: int  # 0 when the model has no MoE layer
    global_batch_size: int
    num_kv_heads: int = 0  # 0 when unknown or equal to num_heads
    micro_batch_sizes: tuple[int, ...] = (1, 2, 4, 8)
    max_cp: int = 16
    min_seq_for_cp: int = 16384  # context parallelism only pays for long sequences
    # 0: pp bounded by the repeated layers only; 1: the runtime cannot cut this model into
    # pipeline stages (`autopar.runtime.parts`), so no pipeline plan is offered
    max_pp: int = 0
    # likewise for tensor parallelism (`autopar.runtime.tensor_parallel.splits_every_block`)
    max_tp: int = 0
    # pipeline plans only with tp = cp = ep = 1: the runtime cuts this model from its traced
    # graph (`autopar.runtime.traced_stages`), whose stages TP, CP and EP cannot split
    pipeline_alone: bool = False
    # asynchronous TP offered instead of plain TP with sequence parallelism (the stack runs it
    # and hides more with it: `CostOptions.async_tp_overlap`)
    async_tp: bool = False
    # ep folded over the tp ranks too (`ParallelConfig.ep_folds_over_tp`: Megatron-Core's
    # MoE parallel folding; a stack that runs it, not autopar's runtime)
    ep_over_tp: bool = False
    # activation offloading tried where a config keeps every activation and does not fit
    # (not on the compiled stack: `runtime.capability`)
    offload: bool = True
    # the recompute_modules sets offered beside the policies, as selective recompute
    # (`estimate.module_regions.module_sets`: a stack that runs Megatron's module recompute)
    recompute_modules: tuple[tuple[str, ...], ...] = ()
    # ZeRO over the context-parallel ranks alone (fsdp = 1, cp > 1, zero 1-3) offered beside
    # plain cp: a stack that shards over them (`CostOptions.fsdp_over_cp`: torchtitan's
    # dp_shard 1 under cp, Megatron's distributed optimizer), not autopar's runtime
    zero_over_cp: bool = False
    # ring attention offered beside the all-gather with cp > 1 (not for a model whose
    # attention drops probabilities: `runtime.attention_check.attention_dropout`)
    cp_ring: bool = True
    # tensor parallelism without sequence parallelism (`runtime.capability`: a block whose
    # projections the runtime cannot pair column/row)
    no_sequence_parallel: bool = False
    # the experts' intermediate width where the runtime can split it over tp (etp = tp;
    # `runtime.capability.expert_width`; under MXFP8 into slices of a multiple of
    # token_multiple), else 0: etp = 1 only
    expert_width: int = 0
    # each rank's share of a sequence (seq_len / cp: sequence parallelism gathers it before
    # the linears) is a multiple of this: MXFP8's 32-element scale blocks run along the
    # tokens in the weight gradient's GEMM (`runtime.capability.token_multiple`); 1: no rule
    token_multiple: int = 1
    # tp splits this width (the MXFP8 linears' greatest common one,
    # `runtime.capability.mxfp8_tp_width`) into shares of a multiple of token_multiple; 0: no
    # such rule
    tp_width: int = 0


def shape_problems(cfg: ParallelConfig, lim: SpaceLimits) -> list[str]:
    """Every way the model's shapes refuse the config's degrees (empty when they divide).

    The same rules `degree_choices` builds in, stated with the numbers for a config the user
    gave: heads (and key/value heads) over tp, repeated layers over pp x virtual stages,
    experts over ep, the sequence over tp (sequence parallelism) and over 2 * cp
    load-balanced chunks.
    """
    out: list[str] = []
    if cfg.tp > 1 and lim.num_heads and lim.num_heads % cfg.tp:
        out.append(f"tp={cfg.tp} does not divide the model's {lim.num_heads} attention heads")
    if cfg.tp > 1 and lim.num_kv_heads and lim.num_kv_heads % cfg.tp:
        out.append(f"tp={cfg.tp} does not divide the model's {lim.num_kv_heads} key/value heads")
    chunks = cfg.pp * cfg.virtual_stages
    slots = len(cfg.pipeline_slots)
    if chunks > 1 and chunks > lim.num_blocks + slots:
        counted = f" (+ the {'+'.join(cfg.pipeline_slots)} slots)" if slots else ""
        hint = ""
        if not slots and chunks <= lim.num_blocks + 2:
            hint = (
                ": pipeline_slots=('embedding', 'loss') counts the embedding and the loss as "
                "a layer each (Megatron's account_for_*_in_pipeline_split)"
            )
        out.append(
            f"pp={cfg.pp} x virtual_stages={cfg.virtual_stages} = {chunks} model chunks but "
            f"the model has {lim.num_blocks} repeated layers{counted} to split{hint}"
        )
    k = cfg.recompute_layers
    if k is not None and k > blocks_per_chunk(lim, cfg):
        out.append(
            f"recompute_layers={k} but each of the pp={cfg.pp} x virtual_stages="
            f"{cfg.virtual_stages} = {chunks} model chunks holds at most "
            f"{blocks_per_chunk(lim, cfg)} of the model's {lim.num_blocks} repeated layers"
        )
    if cfg.ep > 1 and (not lim.num_experts or lim.num_experts % cfg.ep):
        has = f"{lim.num_experts} experts" if lim.num_experts else "no expert layers"
        out.append(f"ep={cfg.ep} does not divide the model's experts: it has {has}")
    if cfg.etp > 1 and not lim.num_experts:
        out.append(f"etp={cfg.etp} splits experts over tp, but the model has no expert layers")
    if cfg.tp > 1 and cfg.sequence_parallel and lim.seq_len % cfg.tp:
        out.append(
            f"sequence_parallel splits the sequence over tp={cfg.tp} ranks, but the blocks' "
            f"sequence of {lim.seq_len} does not divide"
        )
    if cfg.cp > 1 and lim.seq_len % (2 * cfg.cp):
        out.append(
            f"cp={cfg.cp} needs the sequence in 2 x cp = {2 * cfg.cp} equal chunks, "
            f"but seq_len={lim.seq_len} does not divide"
        )
    if lim.token_multiple > 1 and not _tokens_split(lim, cfg.cp):
        out.append(
            f"each rank's share of the sequence (seq_len {lim.seq_len} / cp={cfg.cp}) "
            f"must be a whole multiple of {lim.token_multiple} tokens (MXFP8's scale blocks)"
        )
    if not _width_split(lim, cfg.tp):
        out.append(
            f"tp={cfg.tp} splits the MXFP8 linears' widths (greatest common divisor "
            f"{lim.tp_width}) into shares that are not a multiple of {lim.token_multiple}"
        )
    return out


def blocks_per_chunk(lim: SpaceLimits, cfg: ParallelConfig) -> int:
    """Repeated layers of the fullest model chunk under the even split: the most blocks
    ``recompute_layers`` may name (the pipeline slots count in the split; the fullest chunk
    is a middle one, which holds none)."""
    return -(-(lim.num_blocks + len(cfg.pipeline_slots)) // (cfg.pp * cfg.virtual_stages))


def recompute_layer_choices(lim: SpaceLimits, cfg: ParallelConfig) -> range:
    """The per-layer variants of an all-layer recompute config: recompute_layers = 1 .. the
    blocks of a chunk (ascending: memory falls, time rises); empty for recompute none and for
    module recompute (Megatron applies it to every block)."""
    if cfg.recompute == "none" or cfg.recompute_modules:
        return range(0)
    return range(1, blocks_per_chunk(lim, cfg) + 1)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def degree_choices(lim: SpaceLimits) -> Iterator[tuple[int, int, int, int, int, int]]:
    """(dp, fsdp, cp, tp, pp, ep) tuples that divide everything they must."""
    world = lim.world_size
    for tp in divisors(lim.devices_per_node):
        if world % tp or (lim.num_heads and lim.num_heads % tp) or (lim.max_tp and tp > lim.max_tp):
            continue
        if (lim.num_kv_heads and lim.num_kv_heads % tp) or not _width_split(lim, tp):
            continue
        for pp in divisors(world // tp):
            if pp > max(1, lim.num_blocks) or (lim.max_pp and pp > lim.max_pp):
                continue
            if pp > 1 and tp > 1 and lim.pipeline_alone:
                continue
            for cp in divisors(world // (tp * pp)):
                if cp > 1 and (
                    (pp > 1 and lim.pipeline_alone)
                    or cp > lim.max_cp
                    or lim.seq_len < lim.min_seq_for_cp
                    or lim.seq_len % (2 * cp)
                    or not _tokens_split(lim, cp)
                ):
                    continue
                data = world // (tp * pp * cp)
                for fsdp in divisors(data):
                    dp = data // fsdp
                    alone = pp > 1 and lim.pipeline_alone
                    for ep in [1] if alone else _expert_degrees(lim, dp, fsdp, cp, tp):
                        yield dp, fsdp, cp, tp, pp, ep


def _width_split(lim: SpaceLimits, tp: int) -> bool:
    """Whether ``tp`` splits ``lim.tp_width`` into shares of a multiple of
    ``lim.token_multiple`` (true where there is no such width)."""
    return not lim.tp_width or lim.tp_width % (tp * lim.token_multiple) == 0


def _tokens_split(lim: SpaceLimits, ways: int) -> bool:
    """Whether the sequence splits ``ways`` ways into shares of a multiple of
    ``lim.token_multiple`` tokens."""
    return lim.seq_len % ways == 0 and (lim.seq_len // ways) % lim.token_multiple == 0


def empty_space_reason(lim: SpaceLimits) -> str:
    """Why the space holds no config: which rule left no way to split the world, or the
    batch, with the numbers (what the search says instead of pricing nothing)."""
    world = lim.world_size
    head = f"no parallel config exists for {world} devices ({lim.devices_per_node} per node)"
    degrees = list(degree_choices(lim))
    if not degrees:
        tps = [
            t
            for t in divisors(lim.devices_per_node)
            if not world % t
            and not (lim.num_heads and lim.num_heads % t)
            and not (lim.num_kv_heads and lim.num_kv_heads % t)
        ]
        return (
            f"{head}: world size {world} = dp x fsdp x cp x tp x pp, with tp dividing the "
            f"node's {lim.devices_per_node} devices and the model's {lim.num_heads or '?'} "
            f"attention heads (tp in {tps or 'none'}), pp at most its {lim.num_blocks} "
            f"repeated layers, cp > 1 only for sequences of {lim.min_seq_for_cp} tokens or more "
            f"(this one: {lim.seq_len}); use a device count these divide"
        )
    data = sorted({dp * fsdp for dp, fsdp, *_ in degrees})
    return (
        f"{head}: the global batch of {lim.global_batch_size} sequences must be a multiple of "
        f"micro-batch size ({', '.join(map(str, lim.micro_batch_sizes))}) x data-parallel "
        f"ranks, and the ways to split these devices leave {', '.join(map(str, data))} "
        f"data-parallel ranks; give a global batch that is a multiple of {data[0]}, or fewer "
        "devices"
    )


def _expert_degrees(lim: SpaceLimits, dp: int, fsdp: int, cp: int, tp: int = 1) -> list[int]:
    """ep over the data- and context-parallel ranks, as the runtime folds it (ep divides
    dp x fsdp x cp; `ParallelConfig.problems`), dividing the experts; with
    ``lim.ep_over_tp`` also the degrees that fold over the tp ranks too (dividing
    dp x fsdp x cp x tp only: `ParallelConfig.ep_folds_over_tp`). Not with HSDP (dp and
    fsdp > 1): the experts' state is sharded over all their replicas either way, so HSDP only
    changes the dense part's groups; measured on DeepSeek-V3 / 1,024 H100 the HSDP splits
    priced within 0.1% of fsdp alone, and they were five of the seven splits of each data
    degree the search priced."""
    if not lim.num_experts or (dp > 1 and fsdp > 1):
        return [1]
    ranks = dp * fsdp * cp * (tp if lim.ep_over_tp else 1)
    return [e for e in divisors(ranks) if lim.num_experts % e == 0]


SLOTS = ("embedding", "loss")


def axis_orders(
    degrees: tuple[int, int, int, int, int, int],
) -> list[tuple[str, ...] | None]:
    """The distinct rank layouts of these degrees, as ``axis_order`` values: the axes of degree
    > 1 permuted among their slots of the default order, degree-1 axes left in place; None (the
    default) first, the rest in permutation order.

    >>> axis_orders((2, 1, 1, 4, 1, 1))  # dp=2, tp=4
    [None, ('dp', 'cp', 'fsdp', 'tp')]
    """
    size = dict(zip(("dp", "fsdp", "cp", "tp"), degrees[:4], strict=True))
    slots = [i for i, axis in enumerate(DEFAULT_AXIS_ORDER) if size[axis] > 1]
    moving = [DEFAULT_AXIS_ORDER[i] for i in slots]
    out: list[tuple[str, ...] | None] = []
    for perm in permutations(moving):
        order = list(DEFAULT_AXIS_ORDER)
        for i, axis in zip(slots, perm, strict=True):
            order[i] = axis
        out.append(None if tuple(order) == DEFAULT_AXIS_ORDER else tuple(order))
    return out


def inner_choices(
    lim: SpaceLimits,
    degrees: tuple[int, int, int, int, int, int],
    axis_order: tuple[str, ...] | None = None,
) -> Iterator[ParallelConfig]:
    """Every config with these degrees (laid out in ``axis_order``) whose batch and schedule
    constraints hold."""
    dp, fsdp, cp, tp, pp, ep = degrees
    # ZeRO over fsdp; with fsdp = 1 over the cp ranks alone where the stack shards there
    zeros = (1, 2, 3) if fsdp > 1 else (0, 1, 2, 3) if cp > 1 and lim.zero_over_cp else (0,)
    sp_ok = tp > 1 and not lim.no_sequence_parallel and lim.seq_len % (cp * tp) == 0
    sps = (True, False) if sp_ok else (False,)
    # expert tensor parallelism: each expert whole on every tp rank, or split over them (into
    # slices of a multiple of token_multiple: MXFP8's blocks run along them)
    split = (
        tp > 1
        and lim.num_experts
        and lim.expert_width
        and lim.expert_width % (tp * lim.token_multiple) == 0
    )
    etps = (1, tp) if split else (1,)
    if ep > 1 and (dp * fsdp * cp) % ep:  # folded over tp: whole experts on sequence shards
        sps, etps = (True,) if sp_ok else (), (1,)
    # a traced cut starts chunks at blocks: no chunk for the head alone (the loss slot)
    counted = ("embedding",) if lim.pipeline_alone else SLOTS
    # where the stack runs async TP it hides more of the same traffic at the same memory: a
    # plain TP + SP config is never faster, so only the async one is offered
    async_tps = (True,) if lim.async_tp else (False,)
    cp_attentions = ("all_gather", "ring") if cp > 1 and lim.cp_ring else ("all_gather",)
    policies = [("none", ()), ("selective", ()), ("full", ())]
    policies += [("selective", mods) for mods in lim.recompute_modules]
    for mbs in lim.micro_batch_sizes:
        per_step = mbs * dp * fsdp
        if lim.global_batch_size % per_step:
            continue
        m = lim.global_batch_size // per_step
        for schedule, v, slots in _schedules(pp, m, lim.num_blocks, counted):
            for zero in zeros:
                for sp, etp, (recompute, mods) in product(sps, etps, policies):
                    if recompute != "none" and pp > 1 and schedule in SPLIT_BACKWARD:
                        continue  # ParallelConfig.problems: split backward passes
                    for async_tp, cp_attention in product(
                        async_tps if sp else (False,), cp_attentions
                    ):
                        yield ParallelConfig(
                            dp=dp,
                            fsdp=fsdp,
                            tp=tp,
                            pp=pp,
                            cp=cp,
                            ep=ep,
                            zero_stage=zero,
                            micro_batch_size=mbs,
                            schedule=schedule,  # type: ignore[arg-type]
                            virtual_stages=v,
                            recompute=recompute,  # type: ignore[arg-type]
                            sequence_parallel=sp,
                            axis_order=axis_order,
                            etp=etp,
                            pipeline_slots=slots,
                            async_tp=async_tp,
                            cp_attention=cp_attention,
                            recompute_modules=mods,
                        )


def _schedules(
    pp: int, m: int, num_blocks: int, slots: tuple[str, ...] = SLOTS
) -> list[tuple[str, int, tuple[str, ...]]]:
    """(schedule, virtual stages, pipeline slots) for pp; a multi-chunk schedule also with
    ``slots`` taking a chunk slot each (`_slot_choices`)."""
    if pp == 1:
        return [("1f1b", 1, ())]
    out: list[tuple[str, int, tuple[str, ...]]] = [("gpipe", 1, ()), ("zero_bubble", 1, ())]
    if m >= pp:  # torch's Schedule1F1B needs as many micro-batches as stages
        out.append(("1f1b", 1, ()))
    for v in (2, 3, 4):
        if m % pp == 0:
            out += [("interleaved_1f1b", v, s) for s in _slot_choices(num_blocks, pp * v, slots)]
    if m >= 2 * pp:
        out += [("dualpipe_v", 2, s) for s in _slot_choices(num_blocks, 2 * pp, slots)]
    return out


def _slot_choices(num_blocks: int, chunks: int, slots: tuple[str, ...]) -> list[tuple[str, ...]]:
    """Pipeline slots worth pricing for ``chunks`` model chunks: none where the blocks fill
    them; ``slots`` (the embedding and the loss as a layer each: Megatron's
    account_for_*_in_pipeline_split) where that makes a split possible (len(slots) blocks
    short at most) or even (126 layers + 2 over 32 or 64 chunks)."""
    out: list[tuple[str, ...]] = [()] if num_blocks >= chunks else []
    units = num_blocks + len(slots)
    even = units % chunks == 0 and num_blocks % chunks != 0
    if units >= chunks and (not out or even):
        out.append(slots)
    return out
