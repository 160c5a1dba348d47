"""Tensor and sequence parallelism on DTensor: plan placements -> a TP plan -> parallelize_module.

In: a model, the plan's `ParallelConfig` and `plan.placements` (per repeated-layer class, the
intra-layer ILP's parameter placements, "S(0)" / "S(1)" / "R"). Out: a *TP plan*, plain data
`{module path: style}` that a generated program prints and passes back, and the model with
its parameters turned into DTensors on the mesh's "tp" axis by torch's `parallelize_module`.

Where the placements come from. With `plan.placements` present, a linear whose weight is
"S(0)" (output features split) is column parallel, "S(1)" (input features split) row
parallel, "R" replicated. Without them, the Megatron rule the estimator prices
(`autopar/estimate/tables.py`): in each attention / MLP the projections that read the block's
input (q/k/v, qkv, fc, gate/up) are column parallel, the one that writes back (o, proj, down)
row parallel. A model with no repeated blocks (the zoo's MLP) is a chain of linears: column,
row, column, ... as the estimator's propagation alternates; a chain that ends sharded gathers
its output. Convolutions, norms (without SP), position embeddings, MoE routers and experts stay
replicated: exact, and what the estimator assumes for them.

Vocabulary parallelism (`vocab_parallel=True`, Megatron's, priced by the estimator: the token
embedding is a tensor-parallel layer with one all-reduce, the head a column-parallel matmul):
the token embedding is split over the vocabulary ("vocab_embedding": each rank looks up its
rows, the output all-reduced), the LM head is column parallel with its logits left sharded
over the vocabulary ("vocab_head"), and the loss runs under torch's `loss_parallel()` (three
small all-reduces per micro-batch: max, sum of exponentials, target logit). A tied head
(GPT) shares the embedding's Shard(0) DTensor. With sequence parallelism and a model whose
token embedding feeds the first block directly (Llama; no position embedding added), the
boundary is Megatron's: the embedding reduce-scatters onto sequence shards, the final norm runs
on them and the head all-gathers its input; otherwise the first block splits its input
locally and the last gathers its output (below).

Exactness: a column-parallel linear whose partner is not row parallel gathers its output
("colwise_gather"), a row-parallel one without a column partner splits its replicated input
itself ("rowwise_from_replicate"); so any placement the ILP picks computes the same numbers.

The styles and the collectives they imply (forward; the backward mirrors them):

    colwise                  none (input replicated); backward: all-reduce of the input grad
    rowwise                  all-reduce of the output (Megatron's g)
    colwise_gather           all-gather of the output
    rowwise_from_replicate   none in (local split); all-reduce of the output
    rowwise_to_seq           reduce-scatter of the output along the sequence (SP)
    sequence_parallel        none: a norm on a sequence shard; bwd: all-reduce of its weight grad
    replicate_in/N           none: input 0 as one replicated DTensor for several colwise
                             users; bwd: one all-reduce of their summed input gradients
    gather_seq/N             all-gather of input 0 along the sequence (SP), N positional inputs
    shard_seq/N              none: input 0 split along the sequence (the first block, SP)
    gather_out               all-gather of the output along the sequence (the last block, SP)
    shard_seq_gather_out/N   both (a model with one block)
    vocab_embedding          all-reduce of the output (vocab-split lookup); bwd: none
    vocab_embedding_seq      reduce-scatter of the output along the sequence; bwd: all-gather
    vocab_head               none (logits stay vocab-sharded); bwd: all-reduce of the input grad
    vocab_head_seq           all-gather of the input along the sequence; bwd: reduce-scatter
    head_norm                a per-head q/k norm (Qwen3) on the rank's heads: bwd weight-grad
                             all-reduce (a replicated weight that saw part of the heads)

Public functions:
    tp_plan(model, config, placements=None, vocab_parallel=False) -> dict[str, str]
    splits_every_block(model, num_blocks) -> bool   # what the planner may offer tp > 1 for
    unsplit_block(model, num_blocks) -> "path (Class)" | None   # the first block it would not
    apply_tensor_parallel(model, tp_mesh, plan) -> model   # re-ties a tied head
    loss_context(plan) -> context manager                   # loss_parallel() for a vocab head
    reduce_partial_grads(model) -> int  # SP norm weight grads: Partial -> Replicate
    collectives_of(style) -> str      # the comment the program prints
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

from autopar.config import ParallelConfig

# Megatron roles by attribute name (zoo, Hugging Face Llama / GPT-2 / Mixtral, torchtitan).
COLUMN_NAMES = frozenset({"qkv", "q_proj", "k_proj", "v_proj", "fc", "gate_proj", "up_proj"})
COLUMN_NAMES |= {"c_attn", "c_fc", "wq", "wk", "wv", "w1", "w3"}
ROW_NAMES = frozenset({"proj", "o_proj", "down_proj", "c_proj", "wo", "w2"})
REPLICATED_SCOPES = frozenset({"experts", "router", "gate"})  # expert parallelism's, or tiny

_COLLECTIVES = {
    "colwise": "fwd: none; bwd: all-reduce of the input gradient (Megatron f)",
    "rowwise": "fwd: all-reduce of the output (Megatron g); bwd: none",
    "colwise_gather": "fwd: all-gather of the output; bwd: split",
    "rowwise_from_replicate": "fwd: local split of the input, all-reduce of the output",
    "rowwise_to_seq": "fwd: reduce-scatter of the output along the sequence; bwd: all-gather",
    "sequence_parallel": "fwd: none (norm on a sequence shard); bwd: weight-grad all-reduce",
    "head_norm": "fwd: none (norm on the rank's heads); bwd: weight-grad all-reduce",
    "replicate_in": "fwd: none; bwd: one all-reduce of the summed input gradient",
    "gather_seq": "fwd: all-gather of the input along the sequence; bwd: reduce-scatter",
    "shard_seq": "fwd: none (local split along the sequence); bwd: all-gather",
    "gather_out": "fwd: all-gather of the output along the sequence; bwd: local split",
    "shard_seq_gather_out": "fwd: local split in, all-gather of the output along the sequence",
    "vocab_embedding": "fwd: all-reduce of the output (vocabulary-split lookup); bwd: none",
    "vocab_embedding_seq": "fwd: reduce-scatter of the output along the sequence; bwd: all-gather",
    "vocab_head": "fwd: none (logits vocab-sharded, loss_parallel); bwd: all-reduce of input grad",
    "vocab_head_seq": "fwd: all-gather of the input along the sequence; bwd: reduce-scatter",
}


def collectives_of(style: str) -> str:
    """What ``style`` (as in a TP plan, with or without "/N") communicates over the tp axis."""
    return _COLLECTIVES[style.split("/")[0]]


def find_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The repeated blocks: items of the outermost ModuleLists whose items hold linears.

    An `nn.ModuleDict` counts as a list: a pipeline chunk (`autopar.runtime.stages`) keeps
    its blocks in one keyed by their original index ("blocks.2", ...), so the TP plan of a
    chunk names the same modules as the whole model's."""
    found: list[tuple[str, nn.Module]] = []
    taken: list[str] = []
    for path, module in model.named_modules():
        listed = isinstance(module, (nn.ModuleList, nn.ModuleDict))
        if not listed or any(path.startswith(t + ".") for t in taken):
            continue
        items = list(module.named_children())
        if items and all(_has_linear(m) and not isinstance(m, nn.Linear) for _, m in items):
            found += [(f"{path}.{name}", m) for name, m in items]
            taken.append(path)
    return found


def splits_every_block(model: nn.Module, num_blocks: int) -> bool:
    """Whether tensor parallelism shards each repeated block of ``model`` (the traced graph
    found ``num_blocks``) as the estimator prices them: `unsplit_block` finds none."""
    return unsplit_block(model, num_blocks) is None


def unsplit_block(model: nn.Module, num_blocks: int) -> str | None:
    """The first repeated block tensor parallelism would not shard as priced ("path (Class)"),
    or None: a block with no column-parallel projection feeding a row-parallel one by the
    Megatron rule (GPT-2's Conv1D, T5's q/k/v/o and wi) would run replicated, or split one
    projection alone, while priced sharded. A model without blocks is a chain of linears."""
    blocks = find_blocks(model)
    if not blocks:
        if num_blocks == 0:
            return None
        listed = [path for path, m in model.named_modules() if isinstance(m, nn.ModuleList)]
        return f"{listed[0] if listed else type(model).__name__} (no nn.Linear in its blocks)"
    plan = tp_plan(model, ParallelConfig(tp=2))
    for path, block in blocks:  # a column-parallel projection feeding a row-parallel one
        styles = {style for key, style in plan.items() if key.startswith(path + ".")}
        if "colwise" not in styles or "rowwise" not in styles:
            return f"{path} ({type(block).__name__})"
    return None


def _has_linear(module: nn.Module) -> bool:
    return any(isinstance(m, nn.Linear) for m in module.modules())


def _num_inputs(module: nn.Module) -> int:
    params = inspect.signature(module.forward).parameters.values()
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return sum(1 for p in params if p.kind in kinds and p.default is inspect.Parameter.empty)


def tp_plan(
    model: nn.Module,
    config: ParallelConfig,
    placements: dict | None = None,
    *,
    vocab_parallel: bool = False,
) -> dict[str, str]:
    """The TP plan of ``model``: module path -> style (see the module docstring).

    Args:
        model: the model (real or meta parameters; only names and structure are read).
        config: the plan's config; tp == 1 gives an empty plan.
        placements: `plan.placements` (class id -> {"layer", "parameters"}), or None for the
            Megatron rule.
        vocab_parallel: split the token embedding and the LM head over the vocabulary (the
            plan the estimator prices; the loss must then run under `loss_context`). Off for
            callers that compute the loss where no loss_parallel() is entered.

    Raises:
        ValueError: sequence parallelism asked for where a block has no column/row pair.
    """
    if config.tp == 1:
        return {}
    weights = _class_weights(model, placements or {})
    blocks = find_blocks(model)
    plan: dict[str, str] = {}
    if not blocks:
        return _chain_plan(model, weights)
    all_pairs = True
    for path, block in blocks:
        block_plan, paired = _block_plan(path, block, weights)
        plan.update(block_plan)
        all_pairs &= paired
    vocab = find_vocab_layers(model, blocks) if vocab_parallel else None
    if config.sequence_parallel:
        if not all_pairs:
            raise ValueError(
                "sequence_parallel needs column/row parallel pairs in every block; the plan's "
                "placements replicate some projections: run without sequence_parallel"
            )
        megatron_ends = vocab is not None and vocab[2] is not None
        _add_sequence_parallel(plan, blocks, split_ends=not megatron_ends)
        if whole := _whole_on_shards(plan, blocks):
            raise ValueError(
                f"sequence_parallel would run {whole} on sequence shards with a replicated "
                "weight (each tp rank's gradient a partial sum): run without sequence_parallel"
            )
        if megatron_ends:
            assert vocab is not None and vocab[2] is not None
            embedding, head, norm = vocab
            return {
                embedding: "vocab_embedding_seq",
                **plan,
                norm: "sequence_parallel",
                head: "vocab_head_seq",
            }
    if not config.sequence_parallel:  # with SP, gather_seq already joins the inputs
        _add_shared_inputs(plan, model)
    if vocab is not None:
        embedding, head, _ = vocab
        return {embedding: "vocab_embedding", **plan, head: "vocab_head"}
    return plan


def _add_shared_inputs(plan: dict[str, str], model: nn.Module) -> None:
    """A module whose input feeds several column-parallel linears (q, k, v; gate, up) takes
    it as one replicated DTensor ("replicate_in"), so autograd sums their partial input
    gradients first and one all-reduce follows, as for a fused QKV (Megatron's f), instead
    of one per linear."""
    users: dict[str, int] = {}
    for key, style in plan.items():
        if style == "colwise":
            parent = key.rsplit(".", 1)[0]
            users[parent] = users.get(parent, 0) + 1
    for parent, count in users.items():
        if count > 1:
            plan[parent] = f"replicate_in/{_num_inputs(model.get_submodule(parent))}"


def find_vocab_layers(
    model: nn.Module, blocks: list[tuple[str, nn.Module]]
) -> tuple[str, str, str | None] | None:
    """(token embedding, LM head, final norm or None) outside the blocks, or None.

    The head is the last Linear outside the blocks whose output size is an Embedding's
    vocabulary; that Embedding is the token embedding. The final norm is given only when the
    embedding's output reaches the first block unchanged in shape terms -- no other Embedding
    (a position table) outside the blocks, not a Hugging Face model -- and a norm module
    follows the blocks: then
    sequence parallelism can start at the embedding and end at the head (Megatron's ends).
    """
    inside = tuple(p + "." for p, _ in blocks)
    outside = [(p, m) for p, m in model.named_modules() if p and not p.startswith(inside)]
    embeddings = {m.num_embeddings: p for p, m in outside if isinstance(m, nn.Embedding)}
    heads = [p for p, m in outside if isinstance(m, nn.Linear) and m.out_features in embeddings]
    if not heads:
        return None
    head = heads[-1]
    embedding = embeddings[model.get_submodule(head).out_features]
    others = [
        p for p, m in outside if isinstance(m, nn.Embedding) and p != embedding
    ]  # a learned position table added to the token embedding
    norms = [p for p, m in outside if "norm" in type(m).__name__.lower()]
    # Hugging Face models derive positions and the causal mask from the embedding output's
    # shape (inputs_embeds), which a sequence shard would halve: they keep the split ends
    transformers = type(model).__module__.startswith("transformers.")
    norm = norms[-1] if norms and not others and not transformers else None
    return embedding, head, norm


def _class_weights(model: nn.Module, placements: dict) -> dict[str, str]:
    """Weight placement per linear module path, from per-class placements (representative
    `layer` prefix swapped for every block of the same class)."""
    out: dict[str, str] = {}
    blocks = find_blocks(model)
    for class_id, entry in placements.items():
        rep = entry["layer"]
        for path, block in blocks:
            if type(block).__name__ != class_id and path != rep:
                continue
            for name, placement in entry["parameters"].items():
                if name.startswith(rep + ".") and name.endswith(".weight"):
                    module = path + name[len(rep) : -len(".weight")]
                    out[module] = placement
    return out


def _block_plan(
    path: str, block: nn.Module, weights: dict[str, str]
) -> tuple[dict[str, str], bool]:
    """Styles of one block's linears, grouped by their parent (attention, MLP); and whether
    every group is a Megatron column/row pair."""
    groups: dict[str, dict[str, list[str]]] = {}
    for name, module in block.named_modules():
        parts = name.split(".")
        if not isinstance(module, nn.Linear) or REPLICATED_SCOPES & set(parts):
            continue
        role = "col" if parts[-1] in COLUMN_NAMES else "row" if parts[-1] in ROW_NAMES else None
        if role is None:
            continue
        full = f"{path}.{name}"
        placement = weights.get(full, "S(0)" if role == "col" else "S(1)")
        groups.setdefault(".".join(parts[:-1]), {"col": [], "row": []})[role].append(
            (full, placement)
        )
    plan: dict[str, str] = {}
    all_pairs = bool(groups)
    for group, members in groups.items():
        cols, rows = members["col"], members["row"]
        paired = all(p == "S(0)" for _, p in cols) and all(p == "S(1)" for _, p in rows)
        paired = paired and bool(cols) and bool(rows)
        all_pairs &= paired
        if paired:  # per-head norms (Qwen3's q_norm, k_norm) on the rank's heads
            scope = block.get_submodule(group) if group else block
            plan.update({f"{path}.{n}": "head_norm" for n in _head_norms(scope, group)})
        for full, placement in cols:
            if placement == "S(0)":
                plan[full] = "colwise" if paired else "colwise_gather"
        for full, placement in rows:
            if placement == "S(1)":
                plan[full] = "rowwise" if paired else "rowwise_from_replicate"
    return plan, all_pairs


def _head_norms(scope: nn.Module, group: str) -> list[str]:
    """Paths (from the block) of the norms in an attention group that normalise each head of a
    column-parallel projection's output: a weight of one head's width, applied per head, so
    on a rank's heads only; replicated, their weight gradients must be summed over tp."""
    out = []
    for name in ("q_norm", "k_norm"):
        norm = getattr(scope, name, None)
        proj = getattr(scope, name[0] + "_proj", None)
        weight = getattr(norm, "weight", None)
        if weight is None or not isinstance(proj, nn.Linear) or weight.dim() != 1:
            continue
        if weight.numel() < proj.out_features and proj.out_features % weight.numel() == 0:
            out.append(f"{group}.{name}" if group else name)
    return out


# styles that take a module's parameters (sharded, or replicated with their gradients summed)
_PARAMETER_STYLES = ("colwise", "rowwise", "sequence_parallel", "head_norm")


def _whole_on_shards(plan: dict[str, str], blocks: list[tuple[str, nn.Module]]) -> str:
    """The first block parameter no style takes (a router, an expert, a gate, a learned scale):
    under sequence parallelism its module sees the rank's sequence shard only, so its
    gradient would be a partial sum. "" when every parameter is taken."""
    for path, block in blocks:
        for name, module in block.named_modules():
            if next(module.parameters(recurse=False), None) is None:
                continue
            key = f"{path}.{name}" if name else path
            if not plan.get(key, "").startswith(_PARAMETER_STYLES):
                return f"{key} ({type(module).__name__})"
    return ""


def _chain_plan(model: nn.Module, weights: dict[str, str]) -> dict[str, str]:
    """A model without blocks: its linears in order, Megatron's alternation (or the
    placements), a sharded end gathered."""
    linears = [p for p, m in model.named_modules() if isinstance(m, nn.Linear)]
    plan: dict[str, str] = {}
    sharded = False  # is the activation entering the next linear split over tp?
    prev = ""
    for path in linears:
        placement = weights.get(path, "S(1)" if sharded else "S(0)")
        if sharded and placement != "S(1)":  # the previous column-parallel one must gather
            plan[prev] = "colwise_gather"
            sharded = False
        if placement == "S(0)":
            plan[path], sharded = "colwise", True
        elif placement == "S(1)":
            plan[path] = "rowwise" if sharded else "rowwise_from_replicate"
            sharded = False
        prev = path
    if sharded:
        plan[linears[-1]] = "colwise_gather"
    return plan


def _add_sequence_parallel(
    plan: dict[str, str], blocks: list[tuple[str, nn.Module]], split_ends: bool = True
) -> None:
    """Norms on sequence shards, attention/MLP inputs gathered, row outputs reduce-scattered;
    the residual stream between blocks stays a local sequence shard (as torchtitan).
    ``split_ends``: the first block splits its input, the last gathers its output (off when
    the embedding and head do it, Megatron's ends)."""
    for i, (path, block) in enumerate(blocks):
        n = _num_inputs(block)
        first, last = split_ends and i == 0, split_ends and i == len(blocks) - 1
        if first and last:
            plan[path] = f"shard_seq_gather_out/{n}"
        elif first:
            plan[path] = f"shard_seq/{n}"
        elif last:
            plan[path] = "gather_out"
        for name, child in block.named_children():
            if "norm" in type(child).__name__.lower():
                plan[f"{path}.{name}"] = "sequence_parallel"
        parents = {
            k.rsplit(".", 1)[0] for k in plan if k.startswith(path + ".") and "wise" in plan[k]
        }
        for parent in parents:
            plan[parent] = f"gather_seq/{_num_inputs(block.get_submodule(parent[len(path) + 1 :]))}"
        for key, style in list(plan.items()):
            if key.startswith(path + ".") and style == "rowwise":
                plan[key] = "rowwise_to_seq"


def _style(style: str) -> ParallelStyle:
    name, _, count = style.partition("/")
    rest = (None,) * (int(count or 1) - 1)
    if name == "colwise":
        return ColwiseParallel()
    if name == "rowwise":
        return RowwiseParallel()
    if name == "colwise_gather":
        return ColwiseParallel(output_layouts=Replicate())
    if name == "rowwise_from_replicate":
        return RowwiseParallel(input_layouts=Replicate())
    if name == "rowwise_to_seq":
        return RowwiseParallel(output_layouts=Shard(1))
    if name == "sequence_parallel":
        return SequenceParallel(use_local_output=True)
    if name == "head_norm":  # [batch, seq, heads, head_dim]: the rank's heads on dim 2
        return SequenceParallel(sequence_dim=2, use_local_output=True)
    if name == "replicate_in":
        return _FirstInput(Replicate(), Replicate(), local=False)
    if name == "gather_seq":  # a DTensor, so q/k/v's partial input grads sum before one RS
        return _FirstInput(Shard(1), Replicate(), local=False)
    if name == "shard_seq":
        return _FirstInput(Replicate(), Shard(1), local=True)
    if name == "gather_out":
        return PrepareModuleOutput(
            output_layouts=Shard(1), desired_output_layouts=Replicate(), use_local_output=True
        )
    if name == "vocab_embedding":
        return RowwiseParallel(input_layouts=Replicate())
    if name == "vocab_embedding_seq":
        return RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
    if name == "vocab_head":
        return ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
    if name == "vocab_head_seq":
        return ColwiseParallel(
            input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False
        )
    if name == "shard_seq_gather_out":
        return PrepareModuleInputOutput(
            input_layouts=(Replicate(), *rest),
            desired_input_layouts=(Shard(1), *rest),
            use_local_input=True,
            output_layouts=Shard(1),
            desired_output_layouts=Replicate(),
        )
    raise ValueError(f"unknown tensor-parallel style {style!r}; known: {', '.join(_COLLECTIVES)}")


class _FirstInput(ParallelStyle):
    """A module's first input -- positional, or the keyword of forward's first parameter
    (Hugging Face attention is called as ``self_attn(hidden_states=...)``) -- made a DTensor
    of ``given`` placement and redistributed to ``wanted``; other inputs pass unchanged.
    torch's PrepareModuleInput needs to know beforehand whether inputs come positionally or
    by keyword; this does not."""

    def __init__(self, given: Placement, wanted: Placement, *, local: bool) -> None:
        super().__init__()
        self.given, self.wanted, self.local = given, wanted, local

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        first = next(iter(inspect.signature(module.forward).parameters))

        def convert(x: Any) -> Any:
            if not isinstance(x, torch.Tensor):
                return x
            if not isinstance(x, DTensor):
                x = DTensor.from_local(x, device_mesh, (self.given,), run_check=False)
            if x.placements != (self.wanted,):
                x = x.redistribute(device_mesh, (self.wanted,))
            return x.to_local() if self.local else x

        def hook(_: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            if args:
                return (convert(args[0]), *args[1:]), kwargs
            if first in kwargs:
                return args, {**kwargs, first: convert(kwargs[first])}
            return args, kwargs

        module.register_forward_pre_hook(hook, with_kwargs=True)
        return module


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, plan: dict[str, str]) -> nn.Module:
    """Turn ``model``'s planned modules into DTensor modules on the 1-D ``tp_mesh`` (in place).

    Module paths are applied in plan order; an empty plan leaves the model as it is. A
    parameter shared by two planned modules (a head tied to its embedding, both Shard(0) over
    the vocabulary) is shared again afterwards: parallelize_module replaces each module's
    parameter on its own, which would untie them.
    """
    if not plan:
        return model
    tied = _tied_parameters(model, plan)
    parallelize_module(model, tp_mesh, {path: _style(s) for path, s in plan.items()})
    for (owner, name), (user, user_name) in tied:
        setattr(model.get_submodule(user), user_name, getattr(model.get_submodule(owner), name))
    return model


def _tied_parameters(
    model: nn.Module, plan: dict[str, str]
) -> list[tuple[tuple[str, str], tuple[str, str]]]:
    """((owner module, name), (user module, name)) for each planned module's parameter that
    an earlier planned module also holds."""
    seen: dict[int, tuple[str, str]] = {}
    out = []
    for path in plan:
        for name, p in model.get_submodule(path).named_parameters(recurse=False):
            if id(p) in seen:
                out.append((seen[id(p)], (path, name)))
            else:
                seen[id(p)] = (path, name)
    return out


def loss_context(plan: dict[str, str]) -> Any:
    """The context the loss and its backward run in: torch's `loss_parallel()` when the plan
    leaves the logits sharded over the vocabulary, otherwise a no-op."""
    if any(style.startswith("vocab_head") for style in plan.values()):
        return loss_parallel()
    return contextlib.nullcontext()


def reduce_partial_grads(model: nn.Module) -> int:
    """All-reduce the gradients DTensor left as partial sums (a sequence-parallel norm's weight
    sees only its sequence shard) into replicated ones, and give every gradient its
    parameter's placements; returns how many partial gradients there were.

    Gradients with the same mesh and placements go in one flat all-reduce (as Megatron
    all-reduces its sequence-parallel layer-norm gradients coalesced), so a step issues one
    call per such group, not one per parameter: the count `Plan.communication` predicts."""
    groups: dict[tuple, list[nn.Parameter]] = {}
    for p in model.parameters():
        g = p.grad
        if isinstance(g, DTensor) and any(pl.is_partial() for pl in g.placements):
            groups.setdefault((id(g.device_mesh), tuple(g.placements)), []).append(p)
    for params in groups.values():
        first = params[0].grad
        assert isinstance(first, DTensor)
        mesh, placements = first.device_mesh, first.placements
        locals_ = [p.grad.to_local() for p in params]  # type: ignore[union-attr]
        flat = torch.cat([t.reshape(-1) for t in locals_])
        for dim, pl in enumerate(placements):
            if pl.is_partial():  # Partial("sum"): DTensor's gradient partials are sums
                dist.all_reduce(flat, group=mesh.get_group(dim))
        replicated = [Replicate() if pl.is_partial() else pl for pl in placements]
        offset = 0
        for p, t in zip(params, locals_, strict=True):
            local = flat[offset : offset + t.numel()].view_as(t)
            offset += t.numel()
            p.grad = DTensor.from_local(
                local, mesh, replicated, run_check=False, shape=p.shape, stride=p.stride()
            )
    for p in model.parameters():
        g = p.grad
        if isinstance(g, DTensor) and isinstance(p, DTensor) and g.placements != p.placements:
            # DTensor's embedding backward from a replicated output gradient gives a
            # replicated weight gradient; the parameter is split over the vocabulary, so
            # keep only this rank's rows (Replicate -> Shard is a local slice, no collective)
            p.grad = g.redistribute(p.device_mesh, p.placements)
    return sum(len(ps) for ps in groups.values())
