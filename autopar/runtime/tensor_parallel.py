"""Tensor and sequence parallelism planned: plan placements -> a TP plan.

In: a model, the plan's `ParallelConfig` and `plan.placements` (per repeated-layer class, the
intra-layer ILP's parameter placements, "S(0)" / "S(1)" / "R"). Out: a *TP plan*, plain data
`{module path: style}` that a generated program prints and passes back;
`autopar.runtime.tp_apply` turns the model's parameters into DTensors on the mesh's "tp" axis
by it (torch's `parallelize_module`).

Where the placements come from. With `plan.placements` present, a linear whose weight is
"S(0)" (output features split) is column parallel, "S(1)" (input features split) row
parallel, "R" replicated. Without them, the Megatron rule the estimator prices
(`autopar/estimate/tables.py`): in each attention / MLP the projections that read the block's
input (q/k/v, qkv, fc, gate/up) are column parallel, the one that writes back (o, proj, down)
row parallel. A block linear these names miss takes the role the estimator's propagation gave
it (``roles``, `Plan.tensor_parallel_roles`: GPT-NeoX's query_key_value, BERT's query and
attention.output.dense), where `autopar.runtime.split_check` found the model's code computes
on its slices; a traced one beside named ones pairs with them (Phi-3's qkv_proj with o_proj).
A linear is an nn.Linear or a `transposed` one (transformers' Conv1D: weight [in, out], so a
placement's dimensions swap). A fused projection whose code cuts its output where it is made
("col/N" in ``roles``, named or not: GPT-2's c_attn, Phi-3's qkv_proj) is "colwise/N": each of
its N pieces split over tp (`autopar.runtime.fused_pieces`). A model with no repeated
blocks (the zoo's MLP) is a chain of linears: column, row, column, ... as the estimator's
propagation alternates; a chain that ends sharded gathers its output. Convolutions, norms
(without SP), position embeddings, MoE routers and experts stay replicated: exact, and what
the estimator assumes for them. With SP, routers and experts run on
the rank's sequence shard (a token's routing and its experts read that token only), so each tp
rank dispatches its own tokens, as Megatron-Core's MoE layer does with SP; their weights stay
whole and their gradients, each rank's tokens' share, are summed over tp after the backward
("token_sum", `reduce_partial_grads`).

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

    colwise[/N]              none (input replicated); backward: all-reduce of the input grad;
                             /N: a fused projection of N pieces, split piece by piece
    rowwise                  all-reduce of the output (Megatron's g)
    colwise_gather           all-gather of the output
    rowwise_from_replicate   none in (local split); all-reduce of the output
    rowwise_to_seq           reduce-scatter of the output along the sequence (SP)
    sequence_parallel        none: a norm on a sequence shard; bwd: all-reduce of its weight grad
    replicate_in/N           none: input 0 as one replicated DTensor for several colwise
                             users; bwd: one all-reduce of their summed input gradients
    gather_seq/N             all-gather of input 0 along the sequence (SP), N positional inputs
    gather_seq_local/N       the same as a plain tensor, for a module with weights no style takes
                             (MLA's down-projections); bwd: a local split (the gradients reach
                             it whole: each column-parallel input all-reduces its own)
    shard_seq/N              none: input 0 split along the sequence (the first block, SP)
    gather_out               all-gather of the output along the sequence (the last block, SP)
    shard_seq_gather_out/N   both (a model with one block)
    vocab_embedding          all-reduce of the output (vocab-split lookup); bwd: none
    vocab_embedding_seq      reduce-scatter of the output along the sequence; bwd: all-gather
    vocab_head               none (logits stay vocab-sharded); bwd: all-reduce of the input grad
    vocab_head_seq           all-gather of the input along the sequence; bwd: reduce-scatter
    head_norm                a per-head q/k norm (Qwen3) on the rank's heads: bwd weight-grad
                             all-reduce (a replicated weight that saw part of the heads)
    token_sum                none: a router or experts on the rank's sequence shard (SP); after
                             the backward one all-reduce of their weight grads over tp
    expert_split             none here: experts split over tp (etp = tp, SP), which
                             `expert_tensor_parallel` slices and wraps after expert parallelism
    latent_kv/R              none: MLA's replicated KV down-projection; bwd: all-reduce of the
                             gradient of its last R outputs (the rotary key all heads share)

Public functions:
    tp_plan(model, config, placements=None, roles=None, vocab_parallel=False) -> dict[str, str]
    splits_every_block(model, num_blocks, roles=None) -> bool   # may the planner offer tp > 1
    unsplit_block(model, num_blocks, roles=None) -> "path (Class)" | None   # the first it would not
    left_whole(model, priced, roles=None) -> "path (Class)" | None  # a priced split it would not
    collectives_of(style) -> str      # the comment the program prints
    STYLES                            # the style names
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable

from torch import nn

from autopar.config import ParallelConfig

# Megatron roles by attribute name (zoo, Hugging Face Llama / GPT-2 / Mixtral, torchtitan).
COLUMN_NAMES = frozenset({"qkv", "q_proj", "k_proj", "v_proj", "fc", "gate_proj", "up_proj"})
COLUMN_NAMES |= {"c_attn", "c_fc", "wq", "wk", "wv", "w1", "w3"}
# multi-head latent attention (DeepSeek-V2/V3): the up-projections split by head, as
# Megatron-Core's MLA does; the down-projections (q_a_proj, kv_a_proj_with_mqa) and their norms
# stay whole
COLUMN_NAMES |= {"q_b_proj", "kv_b_proj"}
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
    "token_sum": "fwd: none (on the rank's sequence shard); after bwd: weight-grad all-reduce",
    "expert_split": "experts split over tp (etp): their own gathers and reduce-scatters",
    "latent_kv": "fwd: none; bwd: all-reduce of the shared rotary key's output gradient (MLA)",
    "replicate_in": "fwd: none; bwd: one all-reduce of the summed input gradient",
    "gather_seq": "fwd: all-gather of the input along the sequence; bwd: reduce-scatter",
    "gather_seq_local": "fwd: all-gather of the input along the sequence; bwd: local split",
    "shard_seq": "fwd: none (local split along the sequence); bwd: all-gather",
    "gather_out": "fwd: all-gather of the output along the sequence; bwd: local split",
    "shard_seq_gather_out": "fwd: local split in, all-gather of the output along the sequence",
    "vocab_embedding": "fwd: all-reduce of the output (vocabulary-split lookup); bwd: none",
    "vocab_embedding_seq": "fwd: reduce-scatter of the output along the sequence; bwd: all-gather",
    "vocab_head": "fwd: none (logits vocab-sharded, loss_parallel); bwd: all-reduce of input grad",
    "vocab_head_seq": "fwd: all-gather of the input along the sequence; bwd: reduce-scatter",
}
STYLES = tuple(_COLLECTIVES)


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
        if items and all(_has_linear(m) and not is_projection(m) for _, m in items):
            found += [(f"{path}.{name}", m) for name, m in items]
            taken.append(path)
    return found


def splits_every_block(
    model: nn.Module, num_blocks: int, roles: dict[str, str] | None = None
) -> bool:
    """Whether tensor parallelism shards each repeated block of ``model`` (the traced graph
    found ``num_blocks``) as the estimator prices them: `unsplit_block` finds none."""
    return unsplit_block(model, num_blocks, roles) is None


def unsplit_block(
    model: nn.Module, num_blocks: int, roles: dict[str, str] | None = None
) -> str | None:
    """The first repeated block tensor parallelism would not shard as priced ("path (Class)"),
    or None: a block with no column-parallel linear (`is_projection`) feeding a row-parallel
    one, by name or by the traced ``roles`` (anything without roles the Megatron names miss),
    would run replicated, or split one projection alone, while priced sharded. A model
    without blocks is a chain of linears."""
    blocks = find_blocks(model)
    if not blocks:
        if num_blocks == 0:
            return None
        listed = [(path, m) for path, m in model.named_modules() if isinstance(m, nn.ModuleList)]
        if not listed:
            return f"{type(model).__name__} (no linear layer in its blocks)"
        path, items = listed[0]
        kinds = [type(m).__name__ for m in items.modules() if _projects(m)]
        how = f": they project through {kinds[0]}" if kinds else ""
        return f"{path} (no linear layer in its blocks{how})"
    plan = tp_plan(model, ParallelConfig(tp=2), roles=roles)
    for path, block in blocks:  # a column-parallel projection feeding a row-parallel one
        styles = {base_style(s) for key, s in plan.items() if key.startswith(path + ".")}
        if "colwise" not in styles or "rowwise" not in styles:
            return f"{path} ({type(block).__name__})"
    return None


def left_whole(
    model: nn.Module, priced: Iterable[str], roles: dict[str, str] | None = None
) -> str | None:
    """The first projection the estimate prices split over tp (``priced``: the trace's
    column/row-parallel weight matmuls) that `tp_plan` with ``roles`` leaves whole, as "path
    (Class)", or None. A block split in part (MPT's MLP by name, its fused Wqkv held back)
    runs more parameters per rank than priced."""
    plan = tp_plan(model, ParallelConfig(tp=2), roles=roles)
    for path in priced:
        if not base_style(plan.get(path, "")).startswith(("colwise", "rowwise")):
            return f"{path} ({type(model.get_submodule(path)).__name__})"
    return None


def _projects(module: nn.Module) -> bool:
    """A module other than a linear (`is_projection`) that multiplies by a matrix of its own."""
    weight = getattr(module, "weight", None)
    matrix = isinstance(weight, nn.Parameter) and weight.dim() == 2
    return matrix and not isinstance(module, nn.Embedding) and not is_projection(module)


def _has_linear(module: nn.Module) -> bool:
    return any(is_projection(m) for m in module.modules())


def transposed(module: nn.Module) -> bool:
    """A linear layer that stores its weight as [in, out] and computes ``x @ weight + bias``
    (Hugging Face's `Conv1D`, GPT-2's and GPT's projections): its output features are the
    weight's dimension 1. Known by its attributes, not its class."""
    weight = getattr(module, "weight", None)
    nx, nf = getattr(module, "nx", None), getattr(module, "nf", None)
    return isinstance(weight, nn.Parameter) and weight.dim() == 2 and weight.shape == (nx, nf)


def is_projection(module: nn.Module) -> bool:
    """A module tensor parallelism splits as a linear: nn.Linear, or a `transposed` one."""
    return isinstance(module, nn.Linear) or transposed(module)


def base_style(style: str) -> str:
    """A TP plan's style without its "/N" (the fused pieces of "colwise/3")."""
    return style.split("/")[0]


def _num_inputs(module: nn.Module) -> int:
    params = inspect.signature(module.forward).parameters.values()
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return sum(1 for p in params if p.kind in kinds and p.default is inspect.Parameter.empty)


def tp_plan(
    model: nn.Module,
    config: ParallelConfig,
    placements: dict | None = None,
    *,
    roles: dict[str, str] | None = None,
    vocab_parallel: bool = False,
) -> dict[str, str]:
    """The TP plan of ``model``: module path -> style (see the module docstring).

    Args:
        model: the model (real or meta parameters; only names and structure are read).
        config: the plan's config; tp == 1 gives an empty plan.
        placements: `plan.placements` (class id -> {"layer", "parameters"}), or None for the
            Megatron rule.
        roles: module path -> "col" | "row" for block linears the Megatron names do not
            cover, as the trace's propagation priced them (`Plan.tensor_parallel_roles`,
            `autopar.estimate.tables.tensor_parallel_roles`); a block's traced pairs form
            one column/row group.
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
        block_plan, paired = _block_plan(path, block, weights, roles or {})
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
        _add_sequence_parallel(
            plan, blocks, split_ends=not megatron_ends, split_experts=config.etp > 1
        )
        if whole := _whole_on_shards(plan, blocks):
            raise ValueError(
                f"sequence_parallel: {whole} holds a weight no tensor-parallel style takes "
                "(neither split, nor a norm, router or experts, whose gradients it sums over "
                "tp): run without sequence_parallel"
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
    of one per linear. Not where a parameter no style takes reads inside the module (MLA's
    down-projections): it would meet a DTensor with a plain weight."""
    users: dict[str, int] = {}
    for key, style in plan.items():
        if base_style(style) == "colwise":
            parent = key.rsplit(".", 1)[0]
            users[parent] = users.get(parent, 0) + 1
    for parent, count in users.items():
        if count > 1 and not _holds_unplanned(model.get_submodule(parent), parent, plan):
            plan[parent] = f"replicate_in/{_num_inputs(model.get_submodule(parent))}"


def _holds_unplanned(scope: nn.Module, prefix: str, plan: dict[str, str]) -> bool:
    """Whether a module inside ``scope`` (at path ``prefix``) holds parameters no style takes
    (MLA's down-projections): given the module's input as a DTensor, it would meet it with a
    plain weight."""
    return any(
        f"{prefix}.{name}" not in plan
        for name, m in scope.named_modules()
        if name and next(m.parameters(recurse=False), None) is not None
    )


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
    tables = [(p, m) for p, m in outside if isinstance(m, nn.Embedding)]
    sizes = {m.num_embeddings for _, m in tables}
    heads = [p for p, m in outside if isinstance(m, nn.Linear) and m.out_features in sizes]
    if not heads:
        return None
    head = heads[-1]
    weight = model.get_submodule(head).weight
    # the head's tied table, else the first of its size (a position table of the same size
    # as the vocabulary, as in a small BERT, comes after the token embedding)
    same = [p for p, m in tables if m.num_embeddings == weight.shape[0]]
    tied = [p for p, m in tables if m.weight is weight]
    embedding = (tied or same)[0]
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


# the group of a block's linears whose roles came from the trace (`tp_plan`'s ``roles``): the
# propagation made each row-parallel one read a column-parallel one's output, so they pair as
# one group whatever modules hold them (BERT's attention.self and attention.output)
_TRACED = "<traced>"


def _block_plan(
    path: str, block: nn.Module, weights: dict[str, str], roles: dict[str, str]
) -> tuple[dict[str, str], bool]:
    """Styles of one block's linears, grouped by their parent (attention, MLP), or as one
    traced group; and whether every group is a Megatron column/row pair. A traced linear
    beside named ones joins their group (Phi-3's qkv_proj with o_proj)."""
    groups: dict[str, dict[str, list[str]]] = {}
    projections = [
        (name, module)
        for name, module in block.named_modules()
        if is_projection(module) and not REPLICATED_SCOPES & set(name.split("."))
    ]
    named = {
        name.rpartition(".")[0]
        for name, _ in projections
        if name.rpartition(".")[2] in COLUMN_NAMES | ROW_NAMES
    }
    for name, module in projections:
        parts = name.split(".")
        full = f"{path}.{name}"
        role = "col" if parts[-1] in COLUMN_NAMES else "row" if parts[-1] in ROW_NAMES else None
        group = ".".join(parts[:-1])
        traced, _, pieces = roles.get(full, "").partition("/")  # "col/3": fused, 3 pieces
        if role is None:
            role, group = traced, group if group in named else _TRACED
        if role not in ("col", "row"):
            continue
        placement = weights.get(full, "S(0)" if role == "col" else "S(1)")
        if transposed(module) and full in weights:  # the weight is [in, out]: dims swapped
            placement = {"S(0)": "S(1)", "S(1)": "S(0)"}.get(placement, placement)
        full_pieces = (full, placement, f"/{pieces}" if pieces else "")
        groups.setdefault(group, {"col": [], "row": []})[role].append(full_pieces)
    plan: dict[str, str] = {}
    all_pairs = bool(groups)
    for group, members in groups.items():
        cols, rows = members["col"], members["row"]
        paired = all(p == "S(0)" for _, p, _ in cols) and all(p == "S(1)" for _, p, _ in rows)
        paired = paired and bool(cols) and bool(rows)
        all_pairs &= paired
        if paired and group != _TRACED:  # per-head norms (Qwen3's q_norm, k_norm)
            scope = block.get_submodule(group) if group else block
            plan.update({f"{path}.{n}": "head_norm" for n in _head_norms(scope, group)})
            key, rope = _shared_rope_key(scope, f"{path}.{group}" if group else path)
            if key:
                plan[key] = f"latent_kv/{rope}"
        for full, placement, pieces in cols:
            if placement == "S(0)":
                plan[full] = ("colwise" if paired else "colwise_gather") + pieces
        for full, placement, _ in rows:
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


def _shared_rope_key(scope: nn.Module, prefix: str) -> tuple[str, int]:
    """In a paired attention group: MLA's (DeepSeek-V2/V3) replicated down-projection
    ``kv_a_proj_with_mqa``, whose last ``qk_rope_head_dim`` outputs are one rotary key every
    head reads. With the up-projection ``kv_b_proj`` split by head, each tp rank reads it for
    its own heads, so that slice's gradient is a partial sum: (its path, the slice's width),
    or ("", 0)."""
    down, up = getattr(scope, "kv_a_proj_with_mqa", None), getattr(scope, "kv_b_proj", None)
    rope = getattr(scope, "qk_rope_head_dim", 0)
    if isinstance(down, nn.Linear) and isinstance(up, nn.Linear) and rope:
        return f"{prefix}.kv_a_proj_with_mqa", int(rope)
    return "", 0


# styles that take a module's parameters (sharded, or replicated with their gradients summed)
_PARAMETER_STYLES = ("colwise", "rowwise", "sequence_parallel", "head_norm", "token_sum",
                     "expert_split")  # fmt: skip


def _whole_on_shards(plan: dict[str, str], blocks: list[tuple[str, nn.Module]]) -> str:
    """The first block parameter no style takes (a learned scale, a convolution): under
    sequence parallelism its module sees the rank's sequence shard only, so its gradient
    would be a partial sum. "" when every parameter is taken (a "token_sum" or
    "expert_split" module's submodules are)."""
    # a token_sum or expert_split module's submodules are taken; a gathered module's run on the
    # whole sequence
    taken = tuple(
        k + "."
        for k, style in plan.items()
        if style in ("token_sum", "expert_split") or style.startswith("gather_seq")
    )
    for path, block in blocks:
        for name, module in block.named_modules():
            if next(module.parameters(recurse=False), None) is None:
                continue
            key = f"{path}.{name}" if name else path
            if not plan.get(key, "").startswith(_PARAMETER_STYLES) and not key.startswith(taken):
                return f"{key} ({type(module).__name__})"
    return ""


def _token_modules(block: nn.Module) -> list[str]:
    """Paths (from the block) of its routers and expert stacks: the outermost modules named
    in `REPLICATED_SCOPES` that hold parameters. They compute each token on its own, so on a
    sequence shard they give that shard's rows exactly."""
    out: list[str] = []
    for name, module in block.named_modules():
        inside = any(name.startswith(p + ".") for p in out)
        scope = name and not inside and name.split(".")[-1] in REPLICATED_SCOPES
        if scope and next(module.parameters(), None) is not None:
            out.append(name)
    return out


def _chain_plan(model: nn.Module, weights: dict[str, str]) -> dict[str, str]:
    """A model without blocks: its linears in order, Megatron's alternation (or the
    placements), a sharded end gathered."""
    linears = [p for p, m in model.named_modules() if is_projection(m)]
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
    plan: dict[str, str],
    blocks: list[tuple[str, nn.Module]],
    split_ends: bool = True,
    split_experts: bool = False,
) -> None:
    """Norms on sequence shards, attention/MLP inputs gathered, row outputs reduce-scattered;
    the residual stream between blocks stays a local sequence shard (as torchtitan).
    ``split_ends``: the first block splits its input, the last gathers its output (off when
    the embedding and head do it, Megatron's ends). ``split_experts``: the experts are split
    over tp (etp), not run whole on the shard and summed."""
    for i, (path, block) in enumerate(blocks):
        n = _num_inputs(block)
        first, last = split_ends and i == 0, split_ends and i == len(blocks) - 1
        if first and last:
            plan[path] = f"shard_seq_gather_out/{n}"
        elif first:
            plan[path] = f"shard_seq/{n}"
        elif last:
            plan[path] = "gather_out"
        for name in _token_modules(block):
            split = split_experts and name.rsplit(".", 1)[-1] == "experts"
            plan[f"{path}.{name}"] = "expert_split" if split else "token_sum"
        # the modules whose column-parallel projections read the whole sequence: gathered
        parents = {
            k.rsplit(".", 1)[0]
            for k in plan
            if k.startswith(path + ".") and base_style(plan[k]) == "colwise"
        }
        if path in parents:
            raise ValueError(
                f"{path} ({type(block).__name__}) calls its column-parallel projections itself, "
                "beside its residual stream: the runtime gathers the sequence at a module "
                "holding them (an attention, an MLP), and the block has none"
            )
        for parent in parents:
            scope = block.get_submodule(parent[len(path) + 1 :])
            local = "_local" if _holds_unplanned(scope, parent, plan) else ""
            plan[parent] = f"gather_seq{local}/{_num_inputs(scope)}"
        # norms on the residual stream, wherever they sit (Llama's and Gemma 2's are children,
        # BERT's post-norms inside attention.output and output): on sequence shards
        gathered = tuple(p + "." for p in parents)
        for name, child in block.named_modules():
            key = f"{path}.{name}"
            norm = name and "norm" in type(child).__name__.lower()
            if norm and key not in plan and not key.startswith(gathered):
                plan[key] = "sequence_parallel"
        for key, style in list(plan.items()):
            if key.startswith(path + ".") and style == "rowwise":
                plan[key] = "rowwise_to_seq"
