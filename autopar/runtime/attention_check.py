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

A model whose blocks make no call through the interface may call torch's SDPA itself (Falcon,
whose "sdpa" implementation cannot be set): a second run keeps "sdpa", has the probe make
transformers' "sdpa" masks, and notes each call of `F.scaled_dot_product_attention` with the
module making it and the mask it was handed. Every call under transformers' causal mask (no
window: a window reaches the runtime only as the interface's ``sliding_window``), or with
none and is_causal, makes the route "direct" (`context_parallel.DirectSDPA` redirects those
calls at run time); a mask the model's own code made (Falcon's ALiBi bias) is refused.

What it does not prove: token mixing outside attention within a block that also attends (a
convolution beside attention) passes. The any-model matrix runs each family it names against
one process (`tests/autopar/runtime/test_any_model.py`).

Public:
    cp_refusal(model, inputs) -> str     # "" when context parallelism computes its attention
    own_code_refusal(model, inputs) -> str  # why not, for a model with no Hugging Face config
    attention_route(model, inputs) -> Route(kind "interface" | "direct" | "", why, callers)
    sdpa_masks(make) -> context           # transformers' "sdpa" masks made by ``make``
    attention_dropout(model) -> float    # the ring (no dropout) refuses a model with p > 0
"""

from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily
from torch.func import functional_call
from torch.overrides import TorchFunctionMode

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
    return attention_route(model, inputs).why


def own_code_refusal(model: nn.Module, inputs: tuple[torch.Tensor, ...]) -> str:
    """Why context parallelism would not run ``model``, which has no Hugging Face config
    (nothing to switch its attention through) and no `autopar.runtime.parts` entry, naming
    the module and the operation: a fake run (few blocks) notes its calls of torch's
    scaled_dot_product_attention and nn.MultiheadAttention's. A call that attends both ways,
    or under a mask the model made, says so (`_refusal`); a model that makes none attends
    over no sequence; a causal one could be computed, but the runtime has no way to run the
    model at a sequence shard's positions. ``inputs``: one sample's, on meta."""
    name = type(model).__name__
    seen = _Seen()
    try:
        _fake_forward(model, inputs, _SDPAWatch(seen, kernels=True), {}, seen)
    except Exception as e:  # its code does not run on fake tensors: nothing can be read
        return _not_on_fake(name, e)
    if why := _refusal(model, seen, _seq_len(inputs)):
        return why
    if not seen.calls:
        return (
            f"{name} calls no scaled dot-product attention (torch's, or nn.MultiheadAttention's): "
            "it attends over no sequence for context parallelism to cut"
        )
    where = {id(m): p for p, m in model.named_modules()}.get(id(seen.calls[0][0]), name)
    return (
        f"{where} attends causally, but {name} has no Hugging Face config whose attention "
        "implementation can be set, nor an autopar.runtime.parts entry: the runtime cannot run "
        "it at a sequence shard's positions"
    )


class Route(NamedTuple):
    """How context parallelism reaches a model's attention: ``kind`` "interface" (through
    transformers' attention interface) or "direct" (the model's own calls of torch's
    scaled_dot_product_attention, made by modules of the classes ``callers``), or "" with
    ``why`` it cannot."""

    kind: str
    why: str = ""
    callers: tuple[type, ...] = ()


def attention_route(model: nn.Module, inputs: tuple[torch.Tensor, ...]) -> Route:
    """How context parallelism reaches ``model``'s attention (`Route`; module docstring)."""
    name = type(model).__name__
    config = getattr(model, "config", None)
    if not hasattr(config, "_attn_implementation"):
        why = "does not call its attention through transformers' attention interface, which"
        return Route("", f"{name} {why} context parallelism replaces")
    if not hasattr(model, "set_attn_implementation"):
        why = "its attention function cannot be replaced by context parallelism's"
        return Route("", f"{name} has no set_attn_implementation: {why}")
    if "position_ids" not in inspect.signature(model.forward).parameters:
        why = "a sequence shard cannot say where it is"
        return Route("", f"{name}.forward takes no position_ids: {why}")
    seq = _seq_len(inputs)
    # a model whose attention does not follow the interface says so (transformers then
    # leaves its implementation as it is): only its own SDPA calls can be replaced
    settable = getattr(model, "_can_set_attn_implementation", lambda: True)()
    if not settable and config._attn_implementation != "sdpa":
        return Route("", (
            f"{name} runs its attention as {config._attn_implementation!r}, which cannot be "
            "set: context parallelism replaces transformers' attention interface or calls of "
            "torch's scaled_dot_product_attention (the 'sdpa' implementation)"
        ))  # fmt: skip
    try:
        silent = f"{name}'s attention"
        if settable:
            seen, silent = _probe(model, inputs, direct=False)
            if not silent:
                return Route("interface", _refusal(model, seen, seq))
        direct, still = _probe(model, inputs, direct=True)
    except Exception as e:  # its code does not run on fake tensors: nothing can be read
        return Route("", _not_on_fake(name, e))
    callers = tuple(dict.fromkeys(type(m) for m, *_ in direct.calls))
    if still or not callers or type(None) in callers:
        return Route("", (
            f"{still or silent} calls no attention through transformers' attention interface "
            "nor torch's scaled_dot_product_attention in a module of its own: its code mixes "
            "the sequence some other way, which context parallelism would cut"
        ))  # fmt: skip
    return Route("direct", _refusal(model, direct, seq), callers)


def _seq_len(inputs: tuple[torch.Tensor, ...]) -> int:
    """The tokens of one sample's first input ([batch, seq, ...]), 0 where it has no sequence."""
    return inputs[0].shape[1] if inputs and inputs[0].dim() > 1 else 0


def _not_on_fake(name: str, e: Exception) -> str:
    """Why nothing could be read of ``name``'s attention: its forward failed on fake tensors
    with ``e`` (its first line)."""
    first = str(e).splitlines()[0][:200] if str(e) else ""
    return f"{name}'s forward does not run on fake tensors ({type(e).__name__}: {first})"


def _probe(model: nn.Module, inputs: tuple[torch.Tensor, ...], direct: bool) -> tuple[_Seen, str]:
    """A fake run of ``model`` (few blocks) noting its attention calls and the masks it asked
    for, and the first block that made none (`_silent_blocks`). ``direct``: the model keeps
    torch's SDPA implementation ("sdpa"), transformers' causal masks for it are the probe's,
    and its calls of `F.scaled_dot_product_attention` are the ones noted; else the probe is
    its attention implementation and its mask function."""
    from transformers import AttentionInterface, AttentionMaskInterface

    seen = _Seen()
    config = model.config
    before = config._attn_implementation
    takes = inspect.signature(model.forward).parameters
    if not direct:
        AttentionInterface.register(PROBE, _attention(seen))
        AttentionMaskInterface.register(PROBE, _mask(seen))
    try:
        if config._attn_implementation != ("sdpa" if direct else PROBE):
            model.set_attn_implementation("sdpa" if direct else PROBE)
        watch = contextlib.nullcontext()
        if direct:
            watch = contextlib.ExitStack()
            watch.enter_context(sdpa_masks(_mask(seen)))
            watch.enter_context(_SDPAWatch(seen))
        # with a cache (even where the config says none): transformers then reads no
        # packing from the positions, a read of values a fake tensor has not
        silent = _fake_forward(
            model, inputs, watch, {"use_cache": True} if "use_cache" in takes else {}, seen
        )
    finally:
        if config._attn_implementation != before:
            model.set_attn_implementation(before)
    return seen, silent


def _fake_forward(
    model: nn.Module, inputs: tuple[torch.Tensor, ...], watch: Any, kwargs: dict, seen: _Seen
) -> str:
    """``model``'s forward on fake tensors of its parameters and ``inputs`` (few blocks,
    `split_check.few_blocks`) within ``watch``, which notes calls in ``seen``; the first block
    that made none (`_silent_blocks`)."""
    with quiet_fake_tensors(), FakeTensorMode(allow_non_fake_inputs=True):
        args = tuple(fake_like(t) for t in inputs)
        with few_blocks(model):
            state = {k: fake_like(v) for k, v in meta_state(model).items()}
            with watch:
                functional_call(model, state, args, kwargs)
            return _silent_blocks(model, {id(m) for m, *_ in seen.calls})


@contextlib.contextmanager
def sdpa_masks(make: Any) -> Any:
    """transformers' "sdpa" masks made by ``make`` within (its mask interface's entry,
    restored after): the probe's here, none under `context_parallel.DirectSDPA`."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS as masks

    held = masks._local_mapping.get("sdpa")
    masks["sdpa"] = make
    try:
        yield
    finally:
        masks._local_mapping.pop("sdpa", None)
        if held is not None:
            masks["sdpa"] = held


def _refusal(model: nn.Module, seen: _Seen, seq: int) -> str:
    """Why the attention calls ``seen`` noted are not what context parallelism computes, or
    "" (module docstring)."""
    name = type(model).__name__
    paths = {id(m): p for p, m in model.named_modules()}
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
        if kind == "sdpa":  # a call of torch's SDPA itself: the mask says all there is
            if window is not None and _reach(window, seq) < seq:
                return (
                    f"{where} calls torch's scaled_dot_product_attention itself under a "
                    f"sliding window of {window}: context parallelism takes a window only "
                    "through transformers' attention interface (its sliding_window argument)"
                )
            if not kwargs.get("is_causal") and not kwargs.get("masked"):
                return (
                    f"{where} calls torch's scaled_dot_product_attention with no mask and "
                    "is_causal=False: it attends both ways"
                )
            continue
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


class _SDPAWatch(TorchFunctionMode):
    """Notes each call of `F.scaled_dot_product_attention` as (the innermost module running,
    "sdpa" or how its mask was made, the mask's window, {is_causal, masked}) and returns an
    empty output of its shape; the innermost module is kept by global forward hooks while
    the mode is on. ``kernels``: nn.MultiheadAttention's calls are noted too, as SDPA calls
    of its module (its functional form calls SDPA where the mode no longer sees it)."""

    def __init__(self, seen: _Seen, kernels: bool = False) -> None:
        super().__init__()
        self.seen, self.stack, self.handles = seen, [], []
        self.kernels = kernels

    def __enter__(self):
        from torch.nn.modules import module as nn_module

        self.handles = [
            nn_module.register_module_forward_pre_hook(self._enter_module),
            nn_module.register_module_forward_hook(self._leave_module),
        ]
        return super().__enter__()

    def __exit__(self, *exc):
        for handle in self.handles:
            handle.remove()
        return super().__exit__(*exc)

    def _enter_module(self, module: nn.Module, args: Any) -> None:
        self.stack.append(module)

    def _leave_module(self, module: nn.Module, args: Any, out: Any) -> None:
        self.stack.pop()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.kernels and func is F.multi_head_attention_forward:
            bound = _MHA_SIGNATURE.bind(*args, **kwargs).arguments
            mask = bound.get("attn_mask")
            facts = {"is_causal": bool(bound.get("is_causal")), "masked": mask is not None}
            module = self.stack[-1] if self.stack else None
            self.seen.calls.append((module, "sdpa" if mask is None else "own", None, facts))
            return func(*args, **kwargs)
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        query, key, value, mask, _, is_causal, *_ = sdpa_arguments(*args, **kwargs)
        kind, window = "sdpa", None
        if mask is not None:
            made = self.seen.masks.get(id(mask))
            kind, window = ("own", None) if made is None else made[1:]
            kind = "sdpa" if kind == "causal" else kind
        module = self.stack[-1] if self.stack else None
        facts = {"is_causal": bool(is_causal), "masked": mask is not None}
        self.seen.calls.append((module, kind, window, facts))
        return query.new_empty(*query.shape[:-1], value.shape[-1])


_MHA_SIGNATURE = inspect.signature(F.multi_head_attention_forward)


def sdpa_arguments(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> tuple:
    """`F.scaled_dot_product_attention`'s arguments, in its order, however they were passed."""
    return query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa


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
