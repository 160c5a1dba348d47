"""Low-precision linears: a plan's FP8 or MXFP8 recipe applied with torchao's training
conversions.

In: the model (full, before any parallel style), its blocks, the plan's precision and config,
the device. Out: a `LowPrecision` record naming the recipe and the converted modules (the
blocks' ``nn.Linear`` layers the recipe covers: every block for the FP8 and MXFP8 recipes;
attention's products, norms, the embedding and the head stay BF16, as the estimate priced them).

FP8 (tensorwise, rowwise): torchao's ``convert_to_float8_training`` swaps each covered
``nn.Linear`` for a ``Float8Linear`` (its GEMMs through ``torch._scaled_mm``); with ZeRO-3 and
per-tensor scales the weights are gathered already cast (``enable_fsdp_float8_all_gather``), as
the estimate prices. MXFP8: torchao's ``quantize_`` with an ``MXFP8TrainingOpConfig`` wraps each
covered linear's weight so that its three GEMMs quantize both operands to e4m3 with one e8m0
scale per 32 elements; FSDP gathers those weights in BF16 (the recipe's ``fp8_all_gather`` is
off). Written by hand: only which modules (autopar's blocks, the recipe's edge blocks) and the
device check; the conversions are torchao's.

Devices: CUDA needs the recipe's tensor cores: FP8 compute capability 8.9 or newer (Ada,
Hopper, Blackwell), MXFP8 10.0 or newer (Blackwell); an older GPU is refused naming it and the
recipe. On the CPU, torch emulates the FP8 GEMMs and torchao's emulated MXFP8 recipe quantizes
and dequantizes around BF16 GEMMs (slowly): the generated program runs there for tests, saying
so. NVFP4 (torchao trains it with Triton kernels only, on Blackwell) is refused: plan it for
another stack and export.
Under tensor parallelism the FP8 linears take the plain DTensor styles: each rank casts its own
shard (a tensorwise scale's amax reduced over the tp ranks by DTensor), and the tensor-parallel
collectives move BF16, as the estimate prices them. torchao's Float8 TP styles, which cast
before the sequence-parallel all-gather, are not used. Under tensor parallelism an MXFP8 linear
runs its GEMMs on the rank's shards (`run_mxfp8_locally`: through DTensor torchao's weight
would run BF16 GEMMs). A dispatched expert's rows, any number of them, are padded with zeros
to whole blocks of 32 around its MXFP8 GEMMs (`mx_padded`). An MXFP8 linear computes in
autocast's dtype, its FP32 weight cast rather than its input (`_mx_linear`). Expert tensor
parallelism slices each expert's weights after the conversion; the slices keep torchao's
wrappers (`wrapped_like`), and `runtime.capability` plans it in MXFP8 where each slice's width
is a multiple of 32.
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Shard

from autopar.config import ParallelConfig
from autopar.config.precision import MX_BLOCK, RECIPES, Recipe, recipe_of
from autopar.models.quiet import import_torchao
from autopar.tracing.layers import linear_of

# the CUDA compute capability whose tensor cores run each GEMM dtype, and their generation
_CUDA_CAPABILITY = {"fp8": ((8, 9), "Ada, Hopper, Blackwell"), "mxfp8": ((10, 0), "Blackwell")}
# torchao's MXFP8 recipe that quantizes in plain PyTorch and runs BF16 GEMMs: the CPU's
_MXFP8_EMULATED = "mxfp8_emulated_rceil"


@dataclass(frozen=True)
class LowPrecision:
    recipe: str
    modules: tuple[str, ...]  # the converted linears' paths
    fsdp_float8_all_gather: bool
    emulated: bool  # True on the CPU: torch emulates the FP8 GEMMs

    def describe(self) -> str:
        gather = ", FSDP gathers FP8 weights" if self.fsdp_float8_all_gather else ""
        where = " (emulated on the CPU)" if self.emulated else ""
        dtype = RECIPES[self.recipe].gemm_dtype.upper()
        return f"{self.recipe}: {len(self.modules)} linears in {dtype}{gather}{where}"


def runnable(recipe: Recipe) -> bool:
    """Whether this runtime trains ``recipe`` (torchao's float8 and MXFP8 recipes)."""
    return recipe.torchao_recipe is not None and recipe.gemm_dtype in _CUDA_CAPABILITY


# what a generated program's --precision takes: the dtypes it trains in and torchao's recipes
RUNTIME_PRECISIONS = ("fp32", "bf16", *(n for n, r in RECIPES.items() if runnable(r)))


def check_device(recipe: Recipe, device: torch.device) -> None:
    """Refuse ``recipe`` on a device whose GEMMs cannot run it.

    Raises:
        RuntimeError: naming the device and the recipe.
    """
    if not runnable(recipe):
        runs = ", ".join(n for n, r in RECIPES.items() if runnable(r))
        raise RuntimeError(
            f"precision {recipe.name!r} is priced but not run by autopar's runtime (torchao "
            f"trains {runs} here): export the plan to a framework that runs it (autopar "
            f"export --to megatron), or plan with precision fp8"
        )
    if device.type == "cuda":
        (need, generation) = _CUDA_CAPABILITY[recipe.gemm_dtype]
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) < need:
            name = torch.cuda.get_device_name(device)
            kind = recipe.gemm_dtype.upper()
            raise RuntimeError(
                f"precision {recipe.name!r} needs {kind} tensor cores (compute capability "
                f"{need[0]}.{need[1]} or newer: {generation}); {name} has {major}.{minor}: "
                "train in bf16"
            )


def block_linears(blocks: list[tuple[str, nn.Module]], recipe: Recipe) -> dict[str, nn.Module]:
    """Every linear layer of the blocks ``recipe`` covers (all but `edge_blocks_in_bf16` at
    each end), by path: what the estimate prices in the recipe. ``nn.Linear``, and
    transformers' ``Conv1D`` (GPT-2's), which torchao does not convert."""
    return {
        f"{path}.{name}" if name else path: module
        for path, block in recipe.covered(blocks)
        for name, module in block.named_modules()
        if isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D"
    }


def covered_linears(blocks: list[tuple[str, nn.Module]], recipe: Recipe) -> list[str]:
    """The paths of the linears ``recipe`` converts: the `block_linears` torchao takes
    (`Recipe.torchao_converts`, the rule the estimate prices them by)."""
    return [
        path
        for path, module in block_linears(blocks, recipe).items()
        if recipe.torchao_converts(linear_of(module))
    ]


def apply_low_precision(
    model: nn.Module,
    blocks: list[tuple[str, nn.Module]],
    precision: str,
    config: ParallelConfig,
    device: torch.device,
) -> LowPrecision | None:
    """Convert ``model``'s covered linears for ``precision``'s recipe, in place, before any
    parallel style is applied; None for a plain dtype.

    Raises:
        RuntimeError: the device or the runtime cannot run the recipe.
    """
    recipe = recipe_of(precision)
    if recipe is None:
        return None
    check_device(recipe, device)
    if not import_torchao():
        raise RuntimeError(
            f"precision {recipe.name!r} converts the linears with torchao, which is not "
            "installed: pip install 'autopar[fp8]' (or torchao), keeping the installed torch"
        )
    paths = covered_linears(blocks, recipe)
    wanted = set(paths)
    gather = recipe.fp8_all_gather and config.zero_stage == 3 and config.fsdp > 1
    if recipe.gemm_dtype == "mxfp8":
        _convert_mxfp8(model, recipe, wanted, device)
    else:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        ao_config = Float8LinearConfig.from_recipe_name(recipe.torchao_recipe)
        if gather:
            ao_config = replace(ao_config, enable_fsdp_float8_all_gather=True)
        if config.ep > 1:  # a dispatched expert's tokens, the weight gradient's inner
            # dimension, come in any number; torch._scaled_mm takes multiples of 16 on a GPU
            ao_config = replace(ao_config, pad_inner_dim=True)
        convert_to_float8_training(
            model, config=ao_config, module_filter_fn=lambda _module, fqn: fqn in wanted
        )
    return LowPrecision(recipe.name, tuple(paths), gather, device.type == "cpu")


def _convert_mxfp8(model: nn.Module, recipe: Recipe, wanted: set[str], device: torch.device):
    """Wrap the weights of ``wanted``'s linears with torchao's MXFP8 training tensor (its
    emulated recipe off CUDA)."""
    from torchao.prototype.moe_training.config import MXFP8TrainingOpConfig, MXFP8TrainingRecipe
    from torchao.quantization import quantize_

    name = recipe.torchao_recipe if device.type == "cuda" else _MXFP8_EMULATED
    ao_config = MXFP8TrainingOpConfig.from_recipe(MXFP8TrainingRecipe(name))
    quantize_(model, ao_config, filter_fn=lambda _module, fqn: fqn in wanted)
    for path in wanted:
        linear = model.get_submodule(path)
        linear.forward = functools.partial(_mx_forward, linear)


def wrapped_like(param: torch.Tensor, tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` in ``param``'s torchao training wrapper, with its settings, where ``param``
    is one (MXFP8's weight; FP8's for FSDP's float8 all-gather); else ``tensor``. Slicing a
    wrapped weight by hand (expert tensor parallelism's `_slice`: ``torch.cat`` of its
    chunks) returns plain tensors, whose MXFP8 GEMMs would run in BF16 and whose FP8 weights
    FSDP would gather in BF16. Rebuilt by the wrapper's own ``__tensor_unflatten__``."""
    if not type(param).__module__.startswith("torchao."):
        return tensor
    attrs, ctx = param.__tensor_flatten__()
    (inner,) = attrs  # torchao's training weights wrap one tensor
    return type(param).__tensor_unflatten__({inner: tensor}, ctx, tensor.shape, tensor.stride())


def run_mxfp8_locally(module: nn.Module) -> bool:
    """Give an MXFP8 linear that tensor parallelism split (its weight a DTensor over the tp
    mesh, sharded on the output or the input features, holding torchao's MXFP8 weight as its
    local shard) a forward on the local shards; True when it did.

    Through DTensor the linear would run BF16 GEMMs: DTensor dispatches the local matmul
    below torchao's weight, which takes over only ``F.linear`` itself. So the rank's shard
    runs ``F.linear`` as torchao's, and the result is handed back as the DTensor the style
    expects: sharded on the features for a column split, a partial sum for a row split (the
    style's output step reduces it). A column split's input gradient is a partial sum over the
    tp ranks, and is declared so. What the styles communicate is unchanged; the GEMMs see every
    token, the features of their shard (`runtime.capability` plans MXFP8 under tp only where
    each shard's width is a multiple of `MX_BLOCK`).

    Raises:
        RuntimeError: the weight is split otherwise (a fused projection's strided shards).
    """
    if not isinstance(module, nn.Linear) or not isinstance(module.weight, DTensor):
        return False
    weight = module.weight
    wrappers = sys.modules.get("torchao.prototype.moe_training.tensor")  # loaded by conversion
    if wrappers is None or not isinstance(
        weight.to_local(), wrappers.MXFP8TrainingWeightWrapperTensor
    ):
        return False
    (placement,) = weight.placements
    if type(placement) is not Shard or placement.dim not in (0, 1):
        raise RuntimeError(
            f"an MXFP8 linear's weight split as {placement} over tp: only column (Shard(0)) "
            "and row (Shard(1)) splits run its GEMMs on the local shards"
        )
    mesh, column = weight.device_mesh, placement.dim == 0
    out_placement = Shard(-1) if column else Partial()

    def forward(x: torch.Tensor) -> torch.Tensor:
        w = module.weight
        local = x.to_local(grad_placements=[Partial()] if column else None)
        out = _mx_linear(local, w.to_local())
        return DTensor.from_local(out, mesh, [out_placement], run_check=False)

    module.forward = forward
    return True


def _mx_forward(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """An MXFP8 linear's forward (no bias: torchao's weight drops it): `_mx_linear` on its
    rows padded to whole blocks (`mx_padded`), the padding's output rows dropped. Under tensor
    parallelism (a DTensor weight) nothing is padded: the styles split the sequence, which the
    planner keeps in whole blocks (`runtime.capability`)."""
    padded = x if isinstance(module.weight, DTensor) else mx_padded(x)
    out = _mx_linear(padded, module.weight)
    if padded is x:
        return out
    return out[: x.shape[:-1].numel()].reshape(*x.shape[:-1], out.shape[-1])


def mx_padded(x: torch.Tensor) -> torch.Tensor:
    """``x``'s rows (every dimension but the last) padded with zeros to a whole number of
    `MX_BLOCK`, as a 2-D tensor; ``x`` itself where they are whole.

    The weight gradient's GEMM scales blocks of 32 along the tokens, and torchao refuses any
    other count; a dispatched expert gets any number. Zero rows leave every product and every
    block's scale as they were."""
    pad = -x.shape[:-1].numel() % MX_BLOCK
    return F.pad(x.reshape(-1, x.shape[-1]), (0, 0, 0, pad)) if pad else x


def _mx_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``F.linear`` with torchao's MXFP8 ``weight``, both operands in the dtype autocast
    computes a linear in (``x``'s without autocast), as autocast casts a plain linear's.

    torchao's emulated GEMM refuses operands of two dtypes, and torchao takes ``F.linear``
    before autocast casts anything. Without FSDP's BF16 gathers the weight stays FP32: the
    weight is cast (torchao's wrapper survives ``.to``), and its BF16 copy saved for the
    backward, as autocast saves a plain linear's. Casting the input up instead saved an FP32
    copy of every converted linear's input (one rank of a 2-layer Llama in MXFP8 measured
    1.07 x the plan's live bytes, 0.97 x in BF16)."""
    device = x.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
    return F.linear(x.to(dtype), weight.to(dtype))
