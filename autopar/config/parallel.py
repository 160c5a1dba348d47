"""ParallelConfig: one point of the search space, checked against a Cluster.

Degrees: world size = dp * fsdp * cp * tp * pp. ``dp`` replicates (gradients
all-reduced), ``fsdp`` shards data-parallel state with ``zero_stage`` 1-3 saying what is sharded
(dp > 1 and fsdp > 1 together is HSDP); ``ep`` is not a further factor: expert layers re-fold
the data- and context-parallel ranks of a stage, so ep divides dp * fsdp * cp (what
`autopar.runtime.expert_parallel` runs; with fsdp > 1 the experts are sharded over the ranks
holding the same ones), or, with etp = 1 and sequence parallelism, dp * fsdp * cp * tp
(Megatron-Core's fold over the tp ranks too: `ep_folds_over_tp`; priced and exported, not run
by autopar's runtime). ``etp`` (expert
tensor parallelism, Megatron-Core's expert_tensor_parallel_size) is 1 (every tp rank runs its
tokens' experts whole) or tp (each expert's intermediate width split over the tp ranks:
`autopar.runtime.expert_tensor_parallel`).
With fsdp = 1, cp > 1 and zero_stage 1-3, ZeRO shards over the cp ranks alone: what
torchtitan (dp_shard 1 under cp) and Megatron's distributed optimizer run; priced where the
stack shards over cp (`CostOptions.fsdp_over_cp`) and offered by the search there
(`SpaceLimits.zero_over_cp`), refused elsewhere. ``micro_batch_size`` is
per rank; global batch = micro_batch_size * num_microbatches * dp * fsdp. ``recompute`` is
the policy; ``recompute_layers`` k applies it to only the first k repeated layers (blocks) of
each model chunk (the whole model when pp = 1; one of the pp x virtual_stages chunks otherwise),
the other blocks keep their activations; None applies it to every layer.
``recompute_modules`` names the parts of each block that recompute="selective" re-runs, as
Megatron-Core's --recompute-modules does (`RECOMPUTE_MODULES`: core_attn, mlp, moe, moe_act,
shared_experts, layernorm, mla_up_proj); empty is torch's selective policy (save the matmul
and attention outputs). Which ops of a block each name covers is found from the trace
(`autopar.estimate.module_regions`).
``pipeline_slots`` makes the embedding and/or the loss (the head) count as a repeated layer
when the blocks are split over the pp * virtual_stages chunks (Megatron's
account_for_embedding/loss_in_pipeline_split: 126 layers + 2 slots over 128 chunks; the first
or last chunk may then hold no block). ``offload_layers`` k keeps the saved activations of the
first k blocks of each model chunk in host memory between their forward and backward
(copied out and back over the host link, overlapped with the next block's compute).
``cp_attention`` is how attention crosses the cp shards: "all_gather" (K and V gathered
before attention) or "ring" (K/V blocks passed around the ring beside each block's attention).
``async_tp`` overlaps each tensor-parallel matmul with its sequence-parallel all-gather or
reduce-scatter (priced by the stack's `CostOptions.async_tp_overlap`). ``axis_order`` lays
the non-pipeline axes on the ranks, innermost (stride 1) first, pp always outermost: None is
`DEFAULT_AXIS_ORDER` (tp, cp, fsdp, dp: tensor parallelism inside a node first); e.g.
("fsdp", "tp", "cp", "dp") puts fsdp inside the node and tp across nodes.
Invariant: `ParallelConfig.validate` reports every violated rule at once, with the numbers.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Literal

from autopar.errors import ConfigError

if TYPE_CHECKING:
    from autopar.hardware import Cluster

ScheduleName = Literal["gpipe", "1f1b", "interleaved_1f1b", "zero_bubble", "dualpipe_v"]
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble", "dualpipe_v")
Recompute = Literal["none", "selective", "full"]
RECOMPUTE = ("none", "selective", "full")
# Schedules that place more than one model chunk on a pipeline rank.
_MULTI_CHUNK = {"interleaved_1f1b": "at least 2", "dualpipe_v": "exactly 2"}
DEGREES = ("dp", "fsdp", "cp", "tp", "pp")
# Megatron's and torchtitan's rank layout, innermost first: what axis_order=None means.
DEFAULT_AXIS_ORDER = ("tp", "cp", "fsdp", "dp")
# what pipeline_slots may be: the embedding, the loss, or both take a chunk's layer slot
PIPELINE_SLOTS = ((), ("embedding",), ("loss",), ("embedding", "loss"))
# the parts of a block Megatron-Core's selective recompute can re-run (--recompute-modules,
# megatron/core/transformer/transformer_config.py), in its order
RECOMPUTE_MODULES = ("core_attn", "mlp", "moe", "moe_act", "shared_experts", "layernorm",
                     "mla_up_proj")  # fmt: skip
# how attention crosses the context-parallel shards (`autopar.runtime.context_parallel`)
CP_ATTENTION = ("all_gather", "ring")


# the fields to_dict() leaves out at these values (added after plans were first written)
_OMITTED_AT_DEFAULT = {"recompute_layers": None, "axis_order": None, "etp": 1,
                       "pipeline_slots": (), "offload_layers": 0, "async_tp": False,
                       "cp_attention": "all_gather", "recompute_modules": ()}  # fmt: skip


# schedules that split the backward into input- and weight-gradient passes
SPLIT_BACKWARD = ("zero_bubble", "dualpipe_v")


@dataclass(frozen=True)
class ParallelConfig:
    dp: int = 1
    fsdp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    zero_stage: int = 0
    micro_batch_size: int = 1
    schedule: ScheduleName = "1f1b"
    virtual_stages: int = 1
    recompute: Recompute = "none"
    sequence_parallel: bool = False
    # None: the policy on every layer; k: on the first k blocks of each model chunk only.
    # Last, and left out of to_dict() when None, so existing plan.json files stay the same.
    recompute_layers: int | None = None
    # None: DEFAULT_AXIS_ORDER; else dp, fsdp, cp, tp each once, innermost first. Left out of
    # to_dict() when None, like recompute_layers.
    axis_order: tuple[str, ...] | None = None
    # expert tensor parallelism: 1, or tp (the experts split over the tp ranks). Left out of
    # to_dict() when 1, like recompute_layers.
    etp: int = 1
    # pipeline slots the embedding and the loss (head) take as if each were a repeated layer
    # (Megatron's account_for_embedding/loss_in_pipeline_split): () or ("embedding",),
    # ("loss",), ("embedding", "loss"). Left out of to_dict() when empty.
    pipeline_slots: tuple[str, ...] = ()
    # activation offloading: the first k blocks of each model chunk keep their saved
    # activations in host memory between forward and backward (Megatron's
    # cpu_offloading_num_layers; torch's save_on_cpu). 0: none. Left out of to_dict() when 0.
    offload_layers: int = 0
    # asynchronous tensor parallelism: each TP matmul and its all-gather / reduce-scatter
    # split into steps that overlap (torchtitan's async TP, torch._micro_pipeline_tp;
    # Megatron-Core's --tp-comm-overlap). Left out of to_dict() when False.
    async_tp: bool = False
    # how attention crosses the cp shards: "all_gather" (K and V gathered, dK and dV
    # reduce-scattered) or "ring" (K/V blocks passed around the cp ranks, each step beside a
    # block's attention). Left out of to_dict() when all_gather.
    cp_attention: str = "all_gather"
    # with recompute="selective", the parts of each block re-run in the backward (Megatron's
    # --recompute-modules; `RECOMPUTE_MODULES`); () is torch's op policy. Left out of
    # to_dict() when empty.
    recompute_modules: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.axis_order, list):  # as plan.json spells it
            object.__setattr__(self, "axis_order", tuple(self.axis_order))
        if self.axis_order == DEFAULT_AXIS_ORDER:  # one spelling per layout: equal, same JSON
            object.__setattr__(self, "axis_order", None)
        if isinstance(self.pipeline_slots, list):
            object.__setattr__(self, "pipeline_slots", tuple(self.pipeline_slots))
        if isinstance(self.recompute_modules, (list, tuple)) and all(
            m in RECOMPUTE_MODULES for m in self.recompute_modules
        ):  # one spelling per set: Megatron's order, each once
            ordered = tuple(m for m in RECOMPUTE_MODULES if m in self.recompute_modules)
            object.__setattr__(self, "recompute_modules", ordered)

    @property
    def order(self) -> tuple[str, ...]:
        """The non-pipeline axes, innermost (stride 1) first; pp lies outside them all."""
        return DEFAULT_AXIS_ORDER if self.axis_order is None else self.axis_order

    @property
    def strides(self) -> dict[str, int]:
        """Rank stride of every axis (dp, fsdp, cp, tp in `order`, then pp): an axis'
        coordinate is rank // stride % degree."""
        out, stride = {}, 1
        for axis in (*self.order, "pp"):
            out[axis] = stride
            stride *= getattr(self, axis)
        return out

    @property
    def ep_folds_over_tp(self) -> bool:
        """Whether ep spans tensor-parallel ranks: ep > 1 does not divide the dp x fsdp x cp
        ranks but divides them times tp, each expert whole (etp = 1) and each tp rank on its
        own sequence shard (sequence_parallel or tp = 1) -- Megatron-Core's MoE parallel
        folding (DeepSeek-V3's TP2 x EP64 over 32 data ranks). The expert layers then
        regroup the stage's ranks as ep (innermost) x the experts' data replicas."""
        tokens = self.dp * self.fsdp * self.cp
        return (
            self.ep > 1
            and tokens % self.ep != 0
            and (tokens * self.tp) % self.ep == 0
            and self.etp == 1
            and (self.tp == 1 or self.sequence_parallel)
        )

    @property
    def world_size(self) -> int:
        return self.dp * self.fsdp * self.cp * self.tp * self.pp

    @property
    def data_parallel_size(self) -> int:
        """Ranks that see different samples: dp * fsdp."""
        return self.dp * self.fsdp

    def problems(self, cluster: Cluster | None = None) -> list[str]:
        """Every rule this config breaks (empty when valid), each naming the numbers."""
        out: list[str] = []
        for name in (*DEGREES, "ep", "etp", "micro_batch_size", "virtual_stages"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                out.append(f"{name} must be an integer >= 1, got {value!r}")
        if out:
            return out  # the rules below multiply these
        if self.zero_stage not in (0, 1, 2, 3):
            out.append(f"zero_stage must be 0, 1, 2 or 3, got {self.zero_stage!r}")
        elif self.fsdp > 1 and self.zero_stage == 0:
            out.append(f"fsdp={self.fsdp} shards nothing with zero_stage=0: use zero_stage 1-3")
        elif self.fsdp == 1 and self.cp == 1 and self.zero_stage > 0:
            out.append(
                f"zero_stage={self.zero_stage} needs fsdp > 1 to shard over (or cp > 1, on a "
                "stack that shards over the context-parallel ranks), got fsdp=1"
            )
        if self.schedule not in SCHEDULES:
            out.append(f"schedule must be one of {', '.join(SCHEDULES)}, got {self.schedule!r}")
        elif self.schedule in _MULTI_CHUNK:
            rule = _MULTI_CHUNK[self.schedule]
            ok = self.virtual_stages == 2 if rule == "exactly 2" else self.virtual_stages >= 2
            if not ok:
                out.append(
                    f"schedule {self.schedule} needs {rule} virtual_stages, "
                    f"got {self.virtual_stages}"
                )
        elif self.virtual_stages != 1:
            out.append(f"virtual_stages={self.virtual_stages} needs an interleaved or V schedule")
        if self.pp == 1 and self.virtual_stages > 1:
            out.append(f"virtual_stages={self.virtual_stages} needs pp > 1")
        if self.recompute not in RECOMPUTE:
            out.append(f"recompute must be one of {', '.join(RECOMPUTE)}, got {self.recompute!r}")
        if self.pp > 1 and self.recompute != "none" and self.schedule in SPLIT_BACKWARD:
            # torch's selective checkpoint refuses a second backward through a region, and
            # the full one re-runs the forward for each (measured: zero_bubble with full
            # recompute 0.84 s a step against 1f1b's 0.45 s, llama-tiny PP2 on 2 CPU ranks)
            out.append(
                f"schedule {self.schedule} runs the input and the weight gradients as two "
                f"backward passes, which recompute={self.recompute} cannot serve (torch's "
                "checkpointing recomputes per pass); use 1f1b, interleaved_1f1b or gpipe"
            )
        out += self._module_problems()
        off = self.offload_layers
        if isinstance(off, bool) or not isinstance(off, int) or off < 0:
            out.append(f"offload_layers must be an integer >= 0, got {off!r}")
        k = self.recompute_layers
        if k is not None:
            if isinstance(k, bool) or not isinstance(k, int) or k < 1:
                out.append(f"recompute_layers must be None or an integer >= 1, got {k!r}")
            elif self.recompute == "none":
                out.append(
                    f"recompute_layers={k} needs recompute full or selective, got recompute=none"
                )
        order = self.axis_order
        if order is not None and (
            not isinstance(order, tuple) or sorted(map(str, order)) != sorted(DEFAULT_AXIS_ORDER)
        ):
            out.append(
                f"axis_order must list dp, fsdp, cp and tp once each, innermost first (pp is "
                f"always outermost), got {order!r}"
            )
        if self.sequence_parallel and self.tp == 1:
            out.append("sequence_parallel needs tp > 1, got tp=1")
        if self.cp_attention not in CP_ATTENTION:
            out.append(
                f"cp_attention must be one of {', '.join(CP_ATTENTION)}, got {self.cp_attention!r}"
            )
        elif self.cp_attention != "all_gather" and self.cp == 1:
            out.append(f"cp_attention={self.cp_attention} needs cp > 1, got cp=1")
        if self.async_tp and not (self.tp > 1 and self.sequence_parallel):
            out.append(
                f"async_tp overlaps the sequence-parallel all-gathers and reduce-scatters of "
                f"tp > 1: needs tp > 1 and sequence_parallel, got tp={self.tp}"
                + ("" if self.sequence_parallel else " without sequence_parallel")
            )
        slots = self.pipeline_slots
        if not isinstance(slots, tuple) or slots not in PIPELINE_SLOTS:
            out.append(
                f"pipeline_slots must be one of {', '.join(map(repr, PIPELINE_SLOTS))}, "
                f"got {slots!r}"
            )
        elif slots and self.pp == 1:
            out.append(f"pipeline_slots={slots!r} needs pp > 1: there is no split to count in")
        if self.etp not in (1, self.tp):
            out.append(
                f"etp={self.etp} must be 1 (experts whole on every tp rank) or tp={self.tp} "
                "(each expert split over the tp ranks)"
            )
        tokens = self.dp * self.fsdp * self.cp
        if self.ep > 1 and tokens % self.ep and not self.ep_folds_over_tp:
            # autopar's runtime folds ep over the ranks holding different tokens
            # (autopar.runtime.expert_parallel.build_expert_groups); Megatron-Core folds it
            # over the tp ranks too where each holds its own sequence shard (ep_folds_over_tp)
            out.append(
                f"ep={self.ep} must divide the dp x fsdp x cp = {tokens} ranks holding "
                f"different tokens (expert parallelism folds over them): got dp={self.dp}, "
                f"fsdp={self.fsdp}, cp={self.cp}; or dp x fsdp x cp x tp = {tokens * self.tp} "
                "with etp=1 and sequence_parallel (Megatron-Core's fold over the tp ranks)"
            )
        if cluster is not None and self.world_size != cluster.world_size:
            out.append(
                f"degrees dp={self.dp} x fsdp={self.fsdp} x cp={self.cp} x tp={self.tp} x "
                f"pp={self.pp} = {self.world_size}, but the cluster ({cluster.profile.name}) has "
                f"world size {cluster.world_size}"
            )
        return out

    def _module_problems(self) -> list[str]:
        """What is wrong with ``recompute_modules`` (empty when nothing)."""
        mods = self.recompute_modules
        if not isinstance(mods, tuple) or any(m not in RECOMPUTE_MODULES for m in mods):
            return [
                f"recompute_modules must name parts of {', '.join(RECOMPUTE_MODULES)}, got {mods!r}"
            ]
        if mods and self.recompute != "selective":
            return [
                f"recompute_modules={'+'.join(mods)} needs recompute=selective (Megatron's "
                f"selective granularity), got recompute={self.recompute}"
            ]
        if mods and self.recompute_layers is not None:
            return [
                f"recompute_modules={'+'.join(mods)} with recompute_layers="
                f"{self.recompute_layers}: Megatron recomputes named modules in every block"
            ]
        inside = [m for m in ("moe_act", "shared_experts") if m in mods]
        if "moe" in mods and inside:
            return [
                f"recompute_modules: moe re-runs the whole MoE layer, {' and '.join(inside)} "
                "with it; name moe alone"
            ]
        return []

    def validate(self, cluster: Cluster | None = None) -> ParallelConfig:
        """Return self if valid; otherwise raise ConfigError listing every problem."""
        problems = self.problems(cluster)
        if problems:
            raise ConfigError("invalid ParallelConfig:\n  - " + "\n  - ".join(problems))
        return self

    def as_text(self) -> str:
        degrees = " ".join(f"{k}={getattr(self, k)}" for k in (*DEGREES, "ep"))
        if self.etp > 1:
            degrees += f" etp={self.etp}"
        extras = f"zero={self.zero_stage} mbs={self.micro_batch_size} {self.schedule}"
        if self.virtual_stages > 1:
            extras += f" v={self.virtual_stages}"
        extras += f" recompute={self.recompute_text}" + (" +sp" if self.sequence_parallel else "")
        extras += " +async_tp" if self.async_tp else ""
        extras += f" cp_attn={self.cp_attention}" if self.cp_attention != "all_gather" else ""
        if self.axis_order is not None:
            extras += f" order={','.join(self.axis_order)}"
        if self.pipeline_slots:
            extras += f" slots={'+'.join(self.pipeline_slots)}"
        if self.offload_layers:
            extras += f" offload={self.offload_layers}"
        if self.recompute_modules:
            extras += f" modules={'+'.join(self.recompute_modules)}"
        return f"{degrees} | {extras}"

    @property
    def recompute_text(self) -> str:
        """``full`` (every layer), ``full:3`` (the first 3 blocks of each model chunk)."""
        if self.recompute_layers is None:
            return self.recompute
        return f"{self.recompute}:{self.recompute_layers}"

    def to_dict(self) -> dict[str, object]:
        """The fields as JSON values; recompute_layers, axis_order, etp, pipeline_slots,
        offload_layers, async_tp, cp_attention and recompute_modules only when set (plans
        made before they existed load, and save byte-identical)."""
        data = asdict(self)
        for name, default in _OMITTED_AT_DEFAULT.items():
            if data[name] == default:
                del data[name]
        for name in ("pipeline_slots", "recompute_modules"):
            if name in data:
                data[name] = list(data[name])
        return data
