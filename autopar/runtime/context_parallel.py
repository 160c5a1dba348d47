"""Context parallelism: each of the cp ranks holds a shard of every sequence; attention is exact.

In: a model whose attention modules have an `attention_fn` hook (the zoo's `GPTAttention`,
`GQAttention`) or a Hugging Face decoder (its attention-function registry, or its own calls of
torch's SDPA: `DirectSDPA`), the "cp" process group, and per micro-batch the whole sequences.
Out: the model's attention replaced by `CPAttention`, and a `ContextParallel` record that
shards a batch, runs the forward with global positions, computes the loss and sums the
gradients over cp.

Why our own: torch's `context_parallel` has no CPU attention rule in torch 2.13 (its ring
attention dispatches to the flash/efficient CUDA kernels), and gloo is what the tests run on;
so attention is written on torch.distributed collectives, as autograd-correct functions.

Sequence layout (`CPOptions.layout`), S tokens over cp ranks:
    "load_balanced"  cut into 2*cp chunks of S/(2cp); rank i holds chunks i and 2cp-1-i
                     (Megatron-LM's and torch's causal load balancing: every rank gets the
                     same amount of causal attention work)
    "contiguous"     rank i holds tokens [i*S/cp, (i+1)*S/cp)
`positions(seq_len, rank, cp, layout)` lists the global position of each local token; the
model's position embeddings (GPT's learned table, RoPE) are taken at those positions
(`autopar.runtime.parts.run(model, inputs, positions)`), and the causal mask compares them.

Attention (`CPOptions.kind`), q a rank's shard, K/V all shards, mask `pos_k <= pos_q`:
    "all_gather"  K and V all-gathered over cp (backward: dK, dV reduce-scattered), one
                  attention of the local queries against every key under the global mask
    "ring"        K/V blocks passed around the ring (cp - 1 send/recv steps); per block the
                  scores m_b = max, l_b = sum exp(s - m), a_b = exp(s - m) V are merged by
                  online softmax: m = max(m, m_b), l = l e^(m_old - m) + l_b e^(m_b - m), same
                  for a; out = a / l. The own block goes first, so with the causal mask every
                  row's running max is finite (the diagonal) and no exp(-inf - -inf) appears.
Both equal softmax(q K^T * scale + mask) V up to fp32 rounding.

Loss (next-token, as `zoo.lm_loss`): targets are shifted on the whole sequence before
sharding (the last position gets ignore_index), each rank sums cross-entropy over its shard
and divides by the global token count B*(S-1); the value returned is the all-reduced total
(every rank prints the micro-batch's loss) while the gradient is the shard's own term.
Gradients: every parameter's gradient is summed over cp (`ContextParallel.sync_gradients`),
before the data-parallel average.

Public functions:
    CPOptions(layout="load_balanced", kind="all_gather")
    positions(seq_len, rank, cp, layout) -> positions_S        # global positions of a shard
    cp_attention(q, k, v, group, layout, kind, is_causal, scale, dropout_p) -> out
    CPAttention(group, options)                                # SDPA-signature callable
    DirectSDPA(attend)        # mode: a model's own F.scaled_dot_product_attention calls
    apply_context_parallel(model, cp_group, options=None, callers=()) -> ContextParallel
    ContextParallel.shard_batch(inputs, targets) -> (inputs, targets, positions)
    ContextParallel.forward(model, inputs, positions) -> logits of the shard
    ContextParallel.loss(logits, targets) -> loss (value: the micro-batch's global mean)
    ContextParallel.sync_gradients(model)                      # sum over cp
    take_positions(model) -> model        # a model no `parts` entry cuts, called at positions
"""

from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from autopar.models.layers import kv_repeats
from autopar.runtime import parts as model_parts
from autopar.runtime.attention_check import sdpa_arguments, sdpa_masks
from autopar.runtime.collectives import (
    all_gather_seq,
    all_reduce_flat,
    attended,
    local_shard,
    ring_attention,
)
from autopar.runtime.tensor_parallel import is_projection

IGNORE = -100  # F.cross_entropy's default ignore_index
HF_ATTENTION = "autopar_cp"  # the name registered in transformers' AttentionInterface

Layout = Literal["load_balanced", "contiguous"]


@dataclass(frozen=True)
class CPOptions:
    """How the sequence is cut and how attention crosses the cut (module docstring)."""

    layout: Layout = "load_balanced"
    kind: Literal["all_gather", "ring"] = "all_gather"

    def __post_init__(self) -> None:
        if self.layout not in ("load_balanced", "contiguous"):
            raise ValueError(f"CPOptions.layout: load_balanced or contiguous, got {self.layout!r}")
        if self.kind not in ("all_gather", "ring"):
            raise ValueError(f"CPOptions.kind: all_gather or ring, got {self.kind!r}")


def positions(seq_len: int, rank: int, cp: int, layout: Layout, device: Any = None) -> torch.Tensor:
    """The global positions of rank ``rank``'s tokens of a ``seq_len`` sequence (int64).

    >>> positions(8, 1, 2, "load_balanced").tolist()
    [2, 3, 4, 5]
    """
    parts = 2 * cp if layout == "load_balanced" else cp
    if seq_len % parts:
        raise ValueError(
            f"context parallelism: sequence length {seq_len} is not divisible by {parts} "
            f"({'2 x ' if layout == 'load_balanced' else ''}cp={cp}, layout {layout})"
        )
    chunk = seq_len // parts
    chunks = [rank, 2 * cp - 1 - rank] if layout == "load_balanced" else [rank]
    return torch.cat([torch.arange(c * chunk, (c + 1) * chunk, device=device) for c in chunks])


def cp_attention(
    q_BNSD: torch.Tensor,
    k_BKSD: torch.Tensor,
    v_BKSD: torch.Tensor,
    group: dist.ProcessGroup,
    layout: Layout = "load_balanced",
    kind: str = "all_gather",
    is_causal: bool = True,
    scale: float | None = None,
    dropout_p: float = 0.0,
    window: int | None = None,
) -> torch.Tensor:
    """Attention of this rank's queries against the keys of every rank of ``group``.

    q, k, v are this rank's sequence shard `[B, N or K, S/cp, D]` in ``layout``; K key/value
    heads (GQA: K divides N) travel before they are repeated. The output is this shard's
    `[B, N, S/cp, D]`, equal to the matching rows of full attention over the whole sequence.
    ``window``: each query attends to the keys less than ``window`` positions back (itself
    included), as transformers' sliding-window masks (causal only).
    """
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    seq_len = q_BNSD.shape[-2] * cp
    pos_q = positions(seq_len, rank, cp, layout, q_BNSD.device)
    pos_all = [positions(seq_len, r, cp, layout, q_BNSD.device) for r in range(cp)]
    if kind == "ring":
        if dropout_p > 0:
            raise NotImplementedError("ring context-parallel attention has no dropout")
        return ring_attention(
            q_BNSD, k_BKSD, v_BKSD, group, pos_q, pos_all, is_causal, scale, window
        )
    num_heads = q_BNSD.shape[1]
    k_all, v_all = (
        _repeat_heads(all_gather_seq(t, group, dim=-2), num_heads) for t in (k_BKSD, v_BKSD)
    )
    mask = None
    if is_causal:
        mask = attended(pos_q, torch.cat(pos_all), window)
    return F.scaled_dot_product_attention(
        q_BNSD, k_all, v_all, attn_mask=mask, dropout_p=dropout_p, scale=scale
    )


def _repeat_heads(x_BKSD: torch.Tensor, num_heads: int) -> torch.Tensor:
    n = num_heads // x_BKSD.shape[1]
    return x_BKSD if n == 1 else x_BKSD.repeat_interleave(n, dim=1)


class CPAttention:
    """`cp_attention` with `F.scaled_dot_product_attention`'s signature: the value of the zoo
    attention modules' `attention_fn` hook under context parallelism."""

    def __init__(self, group: dist.ProcessGroup, options: CPOptions) -> None:
        self.group, self.options = group, options

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
        enable_gqa: bool = False,
        window: int | None = None,
    ) -> torch.Tensor:
        if attn_mask is not None:
            raise NotImplementedError("context-parallel attention takes no explicit attn_mask")
        kv_repeats(q, k, enable_gqa)  # refuses unequal head counts without enable_gqa
        o = self.options
        return cp_attention(
            q, k, v, self.group, o.layout, o.kind, is_causal, scale, dropout_p, window
        )


def _hf_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-interface signature; the causal mask is ours (from positions,
    within the ``sliding_window`` a layer passes): transformers builds none for an
    implementation without a registered mask kind, and a caller's padding mask is refused
    rather than ignored, as are soft-capped scores and attention sinks (`attention_check`
    refuses such models at planning). K/V heads are gathered before they are repeated for GQA
    (fewer bytes on the wire)."""
    if attention_mask is not None:
        raise NotImplementedError(
            "context parallelism takes whole, unpadded sequences: got an attention mask of "
            f"shape {tuple(attention_mask.shape)}"
        )
    for name in ("softcap", "s_aux"):
        if kwargs.get(name) is not None:
            raise NotImplementedError(f"context-parallel attention has no {name}")
    attend: CPAttention = module.attention_fn
    out = attend(query, key, value, dropout_p=dropout, is_causal=True, scale=scaling,
                 enable_gqa=True, window=kwargs.get("sliding_window"))  # fmt: skip
    return out.transpose(1, 2).contiguous(), None


@dataclass
class ContextParallel:
    """A model under context parallelism and what the training loop calls (module docstring)."""

    group: dist.ProcessGroup
    size: int
    rank: int
    options: CPOptions
    num_attention_modules: int
    route: str = "interface"  # or "direct": the model calls torch's SDPA itself

    def positions(self, seq_len: int, device: Any = None) -> torch.Tensor:
        return positions(seq_len, self.rank, self.size, self.options.layout, device)

    def shard_batch(
        self, inputs: tuple[torch.Tensor, ...], targets: torch.Tensor
    ) -> tuple[tuple[torch.Tensor, ...], torch.Tensor, torch.Tensor]:
        """This rank's shard of whole-sequence token ids `[B, S]` and next-token targets.

        Returns (inputs shard, shifted targets shard with `IGNORE` at the last position,
        global positions `[S/cp]`).
        """
        ids = inputs[0]
        if ids.dim() != 2 or targets.shape != ids.shape:
            raise ValueError(
                f"context parallelism needs token ids [B, S] and targets of the same shape, "
                f"got {tuple(ids.shape)} and {tuple(targets.shape)}"
            )
        pos = self.positions(ids.shape[1], ids.device)
        shifted = torch.cat([targets[:, 1:], torch.full_like(targets[:, :1], IGNORE)], dim=1)
        sharded = tuple(t.index_select(1, pos) if t.dim() >= 2 else t for t in inputs)
        return sharded, shifted.index_select(1, pos), pos

    def forward(
        self, model: nn.Module, inputs: tuple[torch.Tensor, ...], positions_S: torch.Tensor
    ) -> torch.Tensor:
        """The shard's logits: embed at global positions, blocks, head (`parts.run`)."""
        return model_parts.run(model, inputs, positions_S)

    def loss(self, logits_BSV: torch.Tensor, targets_BS: torch.Tensor) -> torch.Tensor:
        """Next-token cross-entropy of the micro-batch, from this rank's shard.

        ``targets_BS`` are `shard_batch`'s shifted targets. Value: the global mean over
        B*(S-1) tokens (all-reduced over cp); gradient: this shard's sum / B*(S-1).
        """
        b, s_local = targets_BS.shape
        count = b * (s_local * self.size - 1)
        local = (
            F.cross_entropy(
                logits_BSV.reshape(-1, logits_BSV.shape[-1]).float(),
                targets_BS.reshape(-1),
                ignore_index=IGNORE,
                reduction="sum",
            )
            / count
        )
        total = local.detach().clone()
        dist.all_reduce(total, group=self.group)
        return local + (total - local.detach())

    def sync_gradients(self, model: nn.Module, skip: frozenset[str] = frozenset()) -> None:
        """Sum every gradient over cp (each rank's holds its shard's terms), in flat buckets
        (`all_reduce_flat`); call after backward, before the data-parallel average. ``skip``:
        parameters summed elsewhere (expert parallelism's experts, folded over cp)."""
        grads = [
            local_shard(p.grad)
            for name, p in model.named_parameters()
            if p.grad is not None and name not in skip
        ]
        all_reduce_flat(grads, self.group)

    def as_text(self) -> str:
        return (
            f"context parallel over cp={self.size} ({self.options.kind} attention, "
            f"{self.options.layout} layout) in {self.num_attention_modules} attention modules"
            + (" (their own calls of torch's SDPA)" if self.route == "direct" else "")
        )


def take_positions(model: nn.Module) -> nn.Module:
    """``model``, callable as a `stages.StageModule` is under context parallelism --
    ``model(*inputs, positions=positions_S)`` -> logits -- when no `parts` entry cuts it: its
    own forward is handed ``position_ids`` (its rotary tables or position embeddings taken at
    the shard's global positions) and no cache, and a Hugging Face output gives its logits.
    Hooks, not a wrapper, so parameter paths (checkpoints, FSDP units) stay the model's."""
    takes = inspect.signature(model.forward).parameters

    def before(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        positions_S = kwargs.pop("positions", None)
        if positions_S is not None:
            kwargs["position_ids"] = positions_S[None, :]
        if "use_cache" in takes:
            kwargs.setdefault("use_cache", False)
        return args, kwargs

    def after(module: nn.Module, args: tuple, kwargs: dict, out: Any) -> Any:
        return getattr(out, "logits", out)

    model.register_forward_pre_hook(before, with_kwargs=True, prepend=True)
    model.register_forward_hook(after, with_kwargs=True)
    return model


class DirectSDPA(TorchFunctionMode):
    """Calls of `F.scaled_dot_product_attention` made by a model's own code (Falcon's, under
    its "sdpa" implementation) computed by `CPAttention`, causal at the shard's global
    positions. `direct_route` turns it on for the model's forward, with transformers making
    no "sdpa" mask (its mask from a shard's positions would be a packed sequence's, cut at
    the shard's seams), so a model that sees none asks SDPA for causal attention; and for
    each module that calls SDPA, whose forward a recompute in backward runs again.
    `attention_check.attention_route` proved at planning that every such call is handed
    transformers' causal mask (no window) or asks for is_causal; a mask that still arrives is
    refused, not ignored.

    Why a mode: the model's code calls torch's function by name, and a mode is how torch lets
    such a call be redirected without patching torch."""

    def __init__(self, attend: CPAttention) -> None:
        super().__init__()
        self.attend = attend

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        q, k, v, mask, dropout_p, _, scale, _ = sdpa_arguments(*args, **kwargs)
        if mask is not None:
            raise NotImplementedError(
                "context parallelism: the model handed torch's scaled_dot_product_attention a "
                f"mask of shape {tuple(mask.shape)} it made itself (transformers made none)"
            )
        return self.attend(q, k, v, dropout_p=dropout_p, is_causal=True, scale=scale,
                           enable_gqa=True)  # fmt: skip


def direct_route(model: nn.Module, callers: tuple[type, ...], attend: CPAttention) -> int:
    """Hooks that run ``model``'s forward, and the forward of each of its modules of a class
    in ``callers`` (those `attention_route` saw call SDPA), under `DirectSDPA` (the model's
    with no "sdpa" masks made): the mode is on once, from the first of them entered to its
    end, so `CPAttention`'s own SDPA call is not redirected again. Returns the number of
    modules of ``callers``."""
    mode = DirectSDPA(attend)
    held: list[contextlib.ExitStack] = []  # the outermost hooked forward's, while it runs
    depth = [0]

    def enter(module: nn.Module, args: Any) -> None:
        depth[0] += 1
        if depth[0] == 1:
            stack = contextlib.ExitStack()
            if module is model:
                stack.enter_context(sdpa_masks(_no_mask))
            stack.enter_context(mode)
            held.append(stack)

    def leave(module: nn.Module, args: Any, out: Any) -> None:
        depth[0] -= 1
        if depth[0] == 0:
            held.pop().close()

    found = [m for m in model.modules() if isinstance(m, callers)]
    for module in (model, *found):
        module.register_forward_pre_hook(enter, prepend=True)
        module.register_forward_hook(leave, always_call=True)
    return len(found)


def _no_mask(**_: Any) -> None:
    return None


def apply_context_parallel(
    model: nn.Module,
    cp_group: dist.ProcessGroup,
    options: CPOptions | None = None,
    callers: tuple[type, ...] = (),
) -> ContextParallel:
    """Route ``model``'s attention through `CPAttention` over ``cp_group`` (in place).

    Zoo models: every module with an `attention_fn` hook gets a `CPAttention` (a GPT with
    `attention="math"` runs the fused path, the same maths). Hugging Face decoders: the
    attention modules get the same callable and the config's attention implementation
    becomes "autopar_cp", registered in transformers' `AttentionInterface`; or, a model whose
    modules of classes ``callers`` call torch's SDPA themselves (`attention_check`'s route
    "direct"), the implementation stays "sdpa" and those calls are redirected
    (`direct_route`).

    Raises:
        ValueError: the model has no attention module autopar can route.
    """
    options = options or CPOptions()
    attend = CPAttention(cp_group, options)
    count = 0
    for module in model.modules():
        if hasattr(module, "attention_fn"):
            module.attention_fn = attend
            if getattr(module, "math", False):
                module.math = False
            count += 1
    config = getattr(model, "config", None)
    if count == 0 and callers:  # its own calls of torch's SDPA, under "sdpa"
        if config._attn_implementation != "sdpa":
            model.set_attn_implementation("sdpa")
        count = direct_route(model, callers, attend)
    elif count == 0 and hasattr(config, "_attn_implementation"):
        from transformers import AttentionInterface

        AttentionInterface.register(HF_ATTENTION, _hf_attention)
        for module in model.modules():
            # an attention module calling the interface holds its projections (Llama's o_proj,
            # GPT-2's c_proj, GPT-NeoX's dense); a wrapper of attention modules holds none
            named = type(module).__name__.endswith("Attention")
            if named and any(is_projection(c) for c in module.children()):
                module.attention_fn = attend
                count += 1
        if config._attn_implementation != HF_ATTENTION:
            model.set_attn_implementation(HF_ATTENTION)
    if count == 0:
        raise ValueError(
            f"context parallelism: {type(model).__name__} has no attention module with an "
            "attention_fn hook (zoo) nor a Hugging Face attention interface"
        )
    return ContextParallel(
        cp_group, dist.get_world_size(cp_group), dist.get_rank(cp_group), options, count,
        "direct" if callers else "interface",
    )  # fmt: skip
