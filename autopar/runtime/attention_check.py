"""Whether context parallelism computes a model's attention, read from the model's own code.

In: a Hugging Face-style model (its config's attention implementation can be switched, as
transformers' `AttentionInterface` allows) and one sample's inputs on the meta device. Out: why
autopar's context-parallel attention would compute something else, naming the module and the
operation, or "".

Under context parallelism the runtime replaces the model's attention function and computes
attention from the tokens' global positions: causal, or causal within the window a call passes
as ``sliding_window`` (`context_parallel.cp_attention`). That is the model's own attention when
every block mixes tokens only through such calls and every mask the model asks for is that
one. A run of the forward on fake tensors (no memory, no ranks; one block of each kind,
`split_check.few_blocks`) with a probe registered as the attention implementation and as its
mask function finds out:

- each mask the model asks transformers for is evaluated on a grid of positions (mask
  functions are functions of indices): causal, causal within a window of w, or something else
  (a bidirectional one; a chunked one, made from the run's tensors) -- named so in the
  refusal;
- each attention call records its module, the mask it was handed, and its keyword arguments:
  a mask of w must come with ``sliding_window=w``, soft-capped scores (``softcap``) and
  attention sinks (``s_aux``) are refused, and a mask made by the model's own code (not
  through transformers) is refused for it cannot be read;
- a repeated block with no attention call mixes its tokens some other way (Mamba2's scan, a
  convolution, nn.MultiheadAttention's own kernel) and is refused, naming its class.

What it does not prove: token mixing outside attention within a block that also attends (a
convolution beside attention) passes. The any-model matrix runs each family it names against
one process (`tests/autopar/runtime/test_any_model.py`).

Public:
    cp_refusal(model, inputs) -> str     # "" when context parallelism computes its attention
    attention_dropout(model) -> float    # the ring (no dropout) refuses a model with p > 0
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily
from torch.func import functional_call

from autopar.models.quiet import quiet_fake_tensors
from autopar.runtime.split_check import fake_like, few_blocks, meta_state
from autopar.runtime.tensor_parallel import find_blocks

PROBE = "autopar_attention_probe"  # registered in transformers' attention and mask interfaces


@dataclass
class _Seen:
    masks: dict[int, tuple[torch.Tensor, str, int | None]] = field(default_factory=dict)
    calls: list[tuple[nn.Module, str, int | None, dict[str, Any]]] = field(default_factory=list)


# where a model states its attention dropout: the zoo GPT's attention modules, Hugging Face
# configs by family
_ATTENTION_DROPOUT_KEYS = ("attention_dropout", "attn_pdrop", "attention_probs_dropout_prob")


def attention_dropout(model: nn.Module) -> float:
    """The dropout probability ``model`` applies to its attention probabilities in training:
    its config's (Hugging Face names) or its attention modules' ``dropout`` (the zoo's), 0.0
    where it states none."""
    config = getattr(model, "config", None)
    for key in _ATTENTION_DROPOUT_KEYS:
        value = getattr(config, key, None)
        if isinstance(value, int | float) and value > 0:
            return float(value)
    for module in model.modules():
        value = getattr(module, "dropout", None)
        if hasattr(module, "attention_fn") and isinstance(value, int | float) and value > 0:
            return float(value)
    return 0.0


def cp_refusal(model: nn.Module, inputs: tuple[torch.Tensor, ...]) -> str:
    """Why context parallelism would not compute ``model``'s attention (module docstring), or
    "". ``inputs``: one sample's, on meta."""
    name = type(model).__name__
    config = getattr(model, "config", None)
    if not hasattr(config, "_attn_implementation"):
        return (
            f"{name} does not call its attention through transformers' attention interface, "
            "which context parallelism replaces"
        )
    if not hasattr(model, "set_attn_implementation"):
        return (
            f"{name} has no set_attn_implementation: its attention function cannot be "
            "replaced by context parallelism's"
        )
    takes = inspect.signature(model.forward).parameters
    if "position_ids" not in takes:
        return f"{name}.forward takes no position_ids: a sequence shard cannot say where it is"
    from transformers import AttentionInterface, AttentionMaskInterface

    seen = _Seen()
    AttentionInterface.register(PROBE, _attention(seen))
    AttentionMaskInterface.register(PROBE, _mask(seen))
    before = config._attn_implementation
    paths = {id(m): p for p, m in model.named_modules()}
    try:
        model.set_attn_implementation(PROBE)
        with quiet_fake_tensors(), FakeTensorMode(allow_non_fake_inputs=True):
            args = tuple(fake_like(t) for t in inputs)
            with few_blocks(model):
                state = {k: fake_like(v) for k, v in meta_state(model).items()}
                # with a cache (even where the config says none): transformers then reads no
                # packing from the positions, a read of values a fake tensor has not
                functional_call(
                    model, state, args, {"use_cache": True} if "use_cache" in takes else {}
                )
                silent = _silent_blocks(model, {id(m) for m, *_ in seen.calls})
    except Exception as e:  # its code does not run on fake tensors: nothing can be read
        first = str(e).splitlines()[0][:200] if str(e) else ""
        return f"{name}'s forward does not run on fake tensors ({type(e).__name__}: {first})"
    finally:
        model.set_attn_implementation(before)
    if silent:
        return (
            f"{silent} calls no attention through transformers' attention interface: its "
            "code mixes the sequence some other way, which context parallelism would cut"
        )
    seq = inputs[0].shape[1] if inputs and inputs[0].dim() > 1 else 0
    for module, kind, window, kwargs in seen.calls:
        where = paths.get(id(module), type(module).__name__)
        if kind == "own":
            return (
                f"{where} is handed an attention mask {name}'s own code made, not one it asked "
                "transformers for, which context parallelism cannot read"
            )
        if kind == "other":
            return (
                f"{where} attends under a mask that is neither causal nor a causal sliding "
                "window (a bidirectional one, or a prefix)"
            )
        if kind == "unread":
            return (
                f"{where} attends under a mask made from the run's own tensors (a chunked "
                "mask), not a causal one or a causal sliding window"
            )
        passed = kwargs.get("sliding_window")
        if _reach(window, seq) != _reach(passed, seq):
            return (
                f"{where} attends within a window of {window or 'all'} tokens but passes "
                f"sliding_window={passed} to the attention function"
            )
        if kwargs.get("softcap") is not None:
            return (
                f"{where} soft-caps its attention scores (at {kwargs['softcap']}) before the "
                "softmax"
            )
        if kwargs.get("s_aux") is not None:
            return f"{where} adds attention sinks (s_aux) to the softmax"
        if not getattr(module, "is_causal", True):
            return f"{where} is not causal"
    return ""


def _reach(window: int | None, seq: int) -> int:
    """How far back a query attends in a sequence of ``seq`` (a window as wide is none)."""
    return seq if window is None or window >= seq else window


def _attention(seen: _Seen):
    def probe(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        mask = seen.masks.get(id(attention_mask)) if attention_mask is not None else None
        if attention_mask is None:
            kind, window = "causal", None  # a causal call skipped the mask (sdpa's is_causal)
        elif mask is None:
            kind, window = "own", None
        else:
            kind, window = mask[1], mask[2]
        seen.calls.append((module, kind, window, kwargs))
        # [batch, seq, heads, value width]: MLA's values are narrower than its queries
        b, heads, seq, _ = query.shape
        return query.new_empty(b, seq, heads, value.shape[-1]), None

    return probe


def _mask(seen: _Seen):
    def probe(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None,
              attention_mask=None, **_: Any) -> torch.Tensor:  # fmt: skip
        with unset_fake_temporarily():  # the mask's values, on real index grids
            q = torch.arange(q_length)[:, None] + q_offset
            k = torch.arange(kv_length)[None, :] + kv_offset
            zero = torch.zeros((), dtype=torch.long)
            try:
                allowed = mask_function(zero, zero, q, k).expand(q_length, kv_length)
                kind, window = _named(allowed, q, k)
            except Exception:  # it reads tensors of the run (a chunked mask's): not plain
                kind, window = "unread", None
        made = torch.empty(batch_size, 1, q_length, kv_length, dtype=torch.bool)
        seen.masks[id(made)] = (made, kind, window)  # kept alive: ids stay unique
        return made

    return probe


def _named(allowed: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[str, int | None]:
    causal = k <= q
    if torch.equal(allowed, causal):
        return "causal", None
    for window in range(1, q.shape[0] + 1):
        if torch.equal(allowed, causal & (k > q - window)):
            return "causal", window
    return "other", None


def _silent_blocks(model: nn.Module, called: set[int]) -> str:
    """The first repeated block (of those run) no attention call came from: "path (Class)"."""
    for path, block in find_blocks(model):
        if not any(id(m) in called for m in block.modules()):
            return f"{path} ({type(block).__name__})"
    return ""
