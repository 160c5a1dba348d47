"""Projections outside the Megatron names split as the trace pairs them, where the model's code
computes on their slices (`autopar.runtime.split_check`; issue 19).

Six small blocks, a list of two each, on meta: a per-head fused QKV (viewed into heads before
its cut, GPT-NeoX's layout) splits; a fused gate/up chunked in two where it is made splits piece
by piece ("col/2"); a fused QKV sliced into pieces of unequal widths or cut into its heads, a
head count fixed in a view, and weights multiplied outside a linear layer are refused, each
with its reason. The runtime then takes the traced pairs into its TP plan (`tp_plan`'s roles;
sequence parallelism, which gathers at a module holding the projections, is refused for a
block that calls them itself), and the evaluated plan carries them for the generated
program."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autopar
from autopar.config import ParallelConfig
from autopar.errors import ConfigError
from autopar.runtime.capability import traced_roles
from autopar.runtime.tensor_parallel import tp_plan
from autopar.tracing import trace

HIDDEN, HEADS, SEQ = 32, 4, 8


class FusedHeads(nn.Module):
    """Attention with one fused projection laid out per head ([head, q|k|v]) and an MLP whose
    linears have names autopar does not know; ``fixed_heads`` views by the config's count."""

    def __init__(self, fixed_heads: bool = False) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN)
        self.packed = nn.Linear(HIDDEN, 3 * HIDDEN)
        self.back = nn.Linear(HIDDEN, HIDDEN)
        self.widen = nn.Linear(HIDDEN, 2 * HIDDEN)
        self.narrow = nn.Linear(2 * HIDDEN, HIDDEN)
        self.fixed_heads = fixed_heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        heads = HEADS if self.fixed_heads else -1
        qkv = self.packed(self.norm(x)).view(b, s, heads, 3 * HIDDEN // HEADS).transpose(1, 2)
        q, k, v = qkv.chunk(3, dim=-1)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.back(att.transpose(1, 2).reshape(b, s, -1))
        return x + self.narrow(F.gelu(self.widen(x)))


class FusedGateUp(nn.Module):
    """An MLP whose fused gate/up projection is chunked in two where it is made (Phi-3's)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate_and_value = nn.Linear(HIDDEN, 4 * HIDDEN)
        self.out = nn.Linear(2 * HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, value = self.gate_and_value(x).chunk(2, dim=-1)
        return x + self.out(F.silu(gate) * value)


class FusedUnequal(nn.Module):
    """A fused projection sliced into q, k, v of unequal widths (fewer key/value heads than
    query heads: Phi-3-medium's qkv_proj)."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(HIDDEN, 2 * HIDDEN)
        self.out = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        qkv = self.qkv(x)
        q, k, v = qkv[..., :HIDDEN], qkv[..., HIDDEN : 3 * HIDDEN // 2], qkv[..., 3 * HIDDEN // 2 :]
        heads = [t.view(b, s, -1, HIDDEN // HEADS).transpose(1, 2) for t in (q, k, v)]
        k, v = (t.repeat_interleave(2, dim=1) for t in heads[1:])
        att = F.scaled_dot_product_attention(heads[0], k, v, is_causal=True)
        return x + self.out(att.transpose(1, 2).reshape(b, s, -1))


class PerHeadCuts(nn.Module):
    """A fused QKV cut into one piece per head where it is made: pieces of one width, but a
    piece-by-piece split would halve each head."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(HIDDEN, 3 * HIDDEN)
        self.out = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        heads = torch.stack(self.qkv(x).split(HIDDEN // HEADS, dim=-1), dim=1)  # [b, 3N, s, d]
        q, k, v = heads.chunk(3, dim=1)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.out(att.transpose(1, 2).reshape(b, s, -1))


class FixedCountViews(nn.Module):
    """Attention whose code views q, k and v by a fixed count that still runs on a tp rank's
    half: OPT's ``view(b, -1, heads, head_dim)`` ("sequence": half the features folded into
    the tokens) or ``view(b, s, heads, -1)`` ("width": heads of half their width)."""

    def __init__(self, by: str = "sequence") -> None:
        super().__init__()
        self.to_q, self.to_k, self.to_v = (nn.Linear(HIDDEN, HIDDEN) for _ in range(3))
        self.to_out = nn.Linear(HIDDEN, HIDDEN)
        self.by = by

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        shape = (b, -1, HEADS, HIDDEN // HEADS) if self.by == "sequence" else (b, s, HEADS, -1)
        q, k, v = (p(x).view(*shape).transpose(1, 2) for p in (self.to_q, self.to_k, self.to_v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.to_out(att.transpose(1, 2).reshape(b, s, -1))


class ViewedPieces(nn.Module):
    """A fused q|k|v viewed as (3, heads, head_dim) and unbound (ModernBERT's Wqkv): no cut
    where it is made, but its pieces are a dimension of the view."""

    config = type("Config", (), {"num_attention_heads": HEADS, "hidden_size": HIDDEN})()

    def __init__(self) -> None:
        super().__init__()
        self.packed = nn.Linear(HIDDEN, 3 * HIDDEN)
        self.out = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.packed(x).view(b, s, 3, -1, HIDDEN // HEADS).unbind(dim=2)
        att = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)))
        return x + self.out(att.transpose(1, 2).reshape(b, s, -1))


class OwnWeights(nn.Module):
    """Weights multiplied in the block's own code (nn.MultiheadAttention's in_proj_weight)."""

    def __init__(self) -> None:
        super().__init__()
        self.mix = nn.Parameter(torch.randn(2 * HIDDEN, HIDDEN) * 0.02)
        self.out = nn.Linear(2 * HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.out(F.relu(x @ self.mix.t()))


class Stack(nn.Module):
    def __init__(self, block: type[nn.Module], **kwargs) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([block(**kwargs) for _ in range(2)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


class Config:
    """What a Hugging Face config says of the heads (their width, for the per-head check)."""

    num_attention_heads, hidden_size = HEADS, HIDDEN


def _roles(model: nn.Module) -> tuple[dict[str, str], str]:
    return tuple(traced_roles(model, trace(model, (torch.randn(1, SEQ, HIDDEN),))))[:2]


def test_a_per_head_fused_projection_splits_as_the_trace_pairs_it():
    model = Stack(FusedHeads)
    roles, why = _roles(model)
    assert why == ""
    assert roles["blocks.1.packed"] == "col" and roles["blocks.1.back"] == "row"
    assert roles["blocks.0.widen"] == "col" and roles["blocks.0.narrow"] == "row"
    plan = tp_plan(model, ParallelConfig(tp=2), roles=roles)
    assert plan["blocks.0.packed"] == "colwise" and plan["blocks.0.back"] == "rowwise"
    assert plan["blocks.1.widen"] == "colwise" and plan["blocks.1.narrow"] == "rowwise"
    # sequence parallelism gathers at a module holding the projections: a flat block has none
    with pytest.raises(ValueError, match=r"blocks.0 \(FusedHeads\) calls its column-parallel"):
        tp_plan(model, ParallelConfig(tp=2, sequence_parallel=True), roles=roles)
    # without the roles (as before), nothing in these blocks would split
    assert not any(k.startswith("blocks.0.") for k in tp_plan(model, ParallelConfig(tp=2)))


def test_a_fused_projection_cut_where_it_is_made_splits_piece_by_piece():
    """Cut into pieces of one width (a chunk in two, Phi-3's gate_up), it splits piece by
    piece: "col/2" carried to the TP plan as "colwise/2"."""
    model = Stack(FusedGateUp)
    roles, why = _roles(model)
    assert why == ""
    assert roles == {"blocks.0.gate_and_value": "col/2", "blocks.0.out": "row",
                     "blocks.1.gate_and_value": "col/2", "blocks.1.out": "row"}  # fmt: skip
    plan = tp_plan(model, ParallelConfig(tp=2), roles=roles)
    assert plan["blocks.1.gate_and_value"] == "colwise/2" and plan["blocks.1.out"] == "rowwise"


def test_code_that_reads_a_projection_by_position_is_refused_with_its_reason():
    roles, why = _roles(Stack(FusedUnequal))
    assert roles == {}
    assert why == (
        "its code cuts blocks.0.qkv's output into pieces of [32, 16, 16] features: a fused "
        "projection split over tp piece by piece needs pieces of one width"
    )
    per_head = Stack(PerHeadCuts)
    per_head.config = Config()
    roles, why = _roles(per_head)
    assert roles == {} and why == (
        "its code cuts blocks.0.qkv's output into pieces of 8 features, heads being 8 wide: a "
        "fused projection split over tp piece by piece needs pieces of whole heads, two or more"
    )
    roles, why = _roles(Stack(FusedHeads, fixed_heads=True))
    assert roles == {} and why.startswith(
        "its code fails with blocks.0.packed and 7 other projections at 1/2 of their features "
        "(RuntimeError: shape '[1, 8, 4, 24]' is invalid"
    ), why
    roles, why = _roles(Stack(OwnWeights))
    assert roles == {} and why == (
        "blocks.0 (OwnWeights) multiplies by its weights in its own code, not through a "
        "linear layer the runtime can split"
    )


def test_a_view_that_reads_a_share_by_a_fixed_count_is_refused_though_it_runs():
    """Both views run on a rank's half of the features and keep the block's output shape:
    only the reshape itself shows the rank computing another model."""
    roles, why = _roles(Stack(FixedCountViews, by="sequence"))
    assert roles == {} and why.startswith(
        "its code reshapes blocks.0.to_q's output (view) to [1, 4, 4, 8] on a tp rank, where "
        "that rank's share of the whole [1, 8, 4, 8] is [1, 8, 2, 8]"
    ), why
    roles, why = _roles(Stack(FixedCountViews, by="width"))
    assert "(view) to [1, 8, 4, 4] on a tp rank" in why and "is [1, 8, 2, 8]" in why, why


def test_a_fused_projection_viewed_as_pieces_splits_piece_by_piece():
    """(3, heads, head_dim) in the features' place makes the projection three pieces: split as
    one block a rank's "q" would be half the q heads and its "k" the other half."""
    model = Stack(ViewedPieces)
    model.config = ViewedPieces.config
    roles, why = _roles(model)
    assert why == "" and roles == {
        "blocks.0.packed": "col/3", "blocks.0.out": "row",
        "blocks.1.packed": "col/3", "blocks.1.out": "row",
    }  # fmt: skip


def test_where_a_split_share_lands_after_a_reshape():
    from autopar.runtime.share_views import share_dim

    assert share_dim((1, 8, 32), (1, 8, 4, 8), 2) == (2, 1)  # heads by -1
    assert share_dim((1, 4, 8, 8), (1, 4, 64), 1) == (1, 1)  # heads merged back, outermost
    assert share_dim((1, 8, 4, 8), (1, 8, 32), 3) is None  # the head width: not one block
    assert share_dim((1, 8, 96), (1, 8, 3, 4, 8), 2, pieces=3) == (3, 1)  # past the pieces
    assert share_dim((1, 8, 96), (1, 1, 8, 96), 2, pieces=3) == (3, 3)  # unsqueezed around
    assert share_dim((1, 8, 96), (1, 8, 12, 8), 2, pieces=3) is None  # pieces not a dim


def test_evaluate_prices_and_carries_the_pairs_or_refuses_naming_the_reason():
    cluster = autopar.Cluster.from_profile("local_cpu", 1, num_devices=2)
    inputs = (torch.randn(1, SEQ, HIDDEN),)
    plan = autopar.evaluate(
        Stack(FusedHeads), cluster, ParallelConfig(tp=2), inputs, global_batch_size=2
    )
    assert plan.tensor_parallel_roles["blocks.0.packed"] == "col"
    assert autopar.Plan.from_json(plan.to_json()).tensor_parallel_roles == (
        plan.tensor_parallel_roles
    )
    fused = autopar.evaluate(
        Stack(FusedGateUp), cluster, ParallelConfig(tp=2), inputs, global_batch_size=2
    )
    assert fused.tensor_parallel_roles["blocks.1.gate_and_value"] == "col/2"
    try:
        autopar.evaluate(Stack(FusedUnequal), cluster, ParallelConfig(tp=2), inputs,
                         global_batch_size=2)  # fmt: skip
    except ConfigError as e:
        assert "Stack's blocks replicated, blocks.0 (FusedUnequal) first" in str(e)
        assert "cuts blocks.0.qkv's output into pieces of [32, 16, 16] features" in str(e)
    else:
        raise AssertionError("tp=2 of a fused projection of unequal pieces was priced")


def test_the_check_runs_one_block_of_each_kind_and_gives_every_block_its_kinds_roles():
    """GPT-2 of 6 blocks: the check runs blocks 0 and 1 (`few_blocks`), finds c_attn fused of
    three pieces, and every block's c_attn gets "col/3"; the model keeps its 6 blocks after.
    A block of another kind (a sliding layer among full ones) is run too."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from autopar.runtime.split_check import few_blocks

    config = GPT2Config(n_layer=6, n_embd=HIDDEN, n_head=HEADS, vocab_size=64, n_positions=16)
    gpt2 = GPT2LMHeadModel(config)
    with few_blocks(gpt2) as alike:
        assert len(gpt2.transformer.h) == 2
        assert alike == {f"transformer.h.{i}": "transformer.h.0" for i in range(2, 6)}
    assert len(gpt2.transformer.h) == 6 and len(list(gpt2.parameters())) == 4 + 6 * 12
    roles, why = traced_roles(gpt2, trace(gpt2, (torch.randint(0, 64, (1, SEQ)),)))[:2]
    assert why == "" and all(roles[f"transformer.h.{i}.attn.c_attn"] == "col/3" for i in range(6))
    from transformers import Qwen2Config, Qwen2ForCausalLM

    qwen2 = Qwen2ForCausalLM(Qwen2Config(
        vocab_size=64, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=6,
        num_attention_heads=HEADS, num_key_value_heads=2, use_sliding_window=True,
        sliding_window=4, layer_types=["full_attention"] * 4 + ["sliding_attention"] * 2,
    ))  # fmt: skip
    with few_blocks(qwen2):
        assert list(qwen2.model.layers._modules) == ["0", "1", "4"]
