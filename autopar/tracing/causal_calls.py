"""A Hugging Face model's causal attention, counted at the FLOPs it runs with.

Under torch.export transformers always makes its causal mask into a tensor and hands it to
scaled_dot_product_attention (`masking_utils._ignore_causal_mask_sdpa` refuses its skip while
exporting), so the trace shows a masked call, counted whole. A run without padding makes no
mask: transformers' "sdpa" attention passes ``is_causal=True`` (`sdpa_attention_forward`:
no mask, more than one query, the module's own ``is_causal``), which the fused kernels run on
the lower triangle alone (`tracing.ops.causal_share`). So an attention call inside a module
that says it is causal, on a layer with neither a sliding window nor chunks, in a model whose
attention runs "sdpa", is counted as its run computes it.
"""

from __future__ import annotations

from torch import nn

from autopar.tracing.nodes import RawNode
from autopar.tracing.ops import causal_share


def count_causal_calls(model: nn.Module, table: list[RawNode]) -> None:
    """Scale the FLOPs of ``table``'s masked attention calls that run causal (module
    docstring) to their causal share, in place."""
    config = getattr(model, "config", None)
    if getattr(config, "_attn_implementation", None) != "sdpa":
        return
    modules = dict(model.named_modules())
    by_name = {r.name: r for r in table}
    for raw in table:
        if raw.op_class != "attention" or not raw.flops or len(raw.tensor_inputs) < 4:
            continue  # no mask: an is_causal call is counted at its probe (tracing.ops)
        module = modules.get(raw.module_stack[-1][0]) if raw.module_stack else None
        query, key = (by_name[i].shapes[0] for i in raw.tensor_inputs[:2])
        if module is None or not _runs_causal(module, config, key[-2]):
            continue
        share = causal_share(query[-2], key[-2])
        raw.flops *= share
        raw.backward_flops *= share


def _runs_causal(module: nn.Module, config: object, keys: int) -> bool:
    """Whether ``module``'s attention runs as a plain causal call over ``keys`` keys: the module
    says it is causal, its layer is a full-attention one (``layer_types``), and no sliding
    window shorter than the keys applies (the module's, or the config's where the model has
    no layer types: Mistral)."""
    if getattr(module, "is_causal", False) is not True:
        return False
    kinds = getattr(config, "layer_types", None)
    index = getattr(module, "layer_idx", None)
    if kinds and index is not None and kinds[index] != "full_attention":
        return False
    window = getattr(module, "sliding_window", None)
    if window is None and not kinds and getattr(config, "use_sliding_window", True):
        window = getattr(config, "sliding_window", None)
    return not window or window >= keys
