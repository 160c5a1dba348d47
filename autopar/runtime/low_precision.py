"""Low-precision linears: a plan's FP8 recipe applied with torchao's float8 training.

In: the model (full, before any parallel style), its blocks, the plan's precision and config,
the device. Out: a `LowPrecision` record naming the recipe and the converted modules (the
blocks' ``nn.Linear`` layers the recipe covers: every block for the FP8 recipes; attention's
products, norms, the embedding and the head stay BF16, as the estimate priced them).

torchao's ``convert_to_float8_training`` swaps each covered ``nn.Linear`` for a
``Float8Linear`` (its GEMMs through ``torch._scaled_mm``); with ZeRO-3 and per-tensor scales
the weights are gathered already cast (``enable_fsdp_float8_all_gather``), as the estimate
prices. Written by hand: only which modules (autopar's blocks, the recipe's edge blocks) and
the device check; the conversion is torchao's.

Devices: CUDA needs FP8 tensor cores (compute capability 8.9 or newer: Ada, Hopper,
Blackwell); an older GPU is refused naming it and the recipe. On the CPU, torch emulates
``_scaled_mm`` (slowly): the generated program runs there for tests, saying so. Recipes that
torchao does not train here (MXFP8, NVFP4) are refused: plan them for another stack and export.
Under tensor parallelism the converted linears take the plain DTensor styles: each rank casts
its own shard (a tensorwise scale's amax reduced over the tp ranks by DTensor), and the
tensor-parallel collectives move BF16, as the estimate prices them. torchao's Float8 TP styles,
which cast before the sequence-parallel all-gather, are not used.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import nn

from autopar.config import ParallelConfig
from autopar.config.precision import RECIPES, Recipe, recipe_of
from autopar.models.quiet import import_torchao

# torch._scaled_mm takes FP8 operands whose dimensions are multiples of 16
_FP8_ALIGN = 16


@dataclass(frozen=True)
class LowPrecision:
    recipe: str
    modules: tuple[str, ...]  # the converted linears' paths
    fsdp_float8_all_gather: bool
    emulated: bool  # True on the CPU: torch emulates the FP8 GEMMs

    def describe(self) -> str:
        gather = ", FSDP gathers FP8 weights" if self.fsdp_float8_all_gather else ""
        where = " (emulated on the CPU)" if self.emulated else ""
        return f"{self.recipe}: {len(self.modules)} linears in FP8{gather}{where}"


def runnable(recipe: Recipe) -> bool:
    """Whether this runtime trains ``recipe`` (torchao's float8 recipes)."""
    return recipe.torchao_recipe is not None


# what a generated program's --precision takes: the dtypes it trains in and torchao's recipes
RUNTIME_PRECISIONS = ("fp32", "bf16", *(n for n, r in RECIPES.items() if runnable(r)))


def check_device(recipe: Recipe, device: torch.device) -> None:
    """Refuse ``recipe`` on a device whose GEMMs cannot run it.

    Raises:
        RuntimeError: naming the device and the recipe.
    """
    if not runnable(recipe):
        raise RuntimeError(
            f"precision {recipe.name!r} is priced but not run by autopar's runtime (torchao "
            f"trains fp8-tensorwise and fp8-rowwise here): export the plan to a framework "
            f"that runs it (autopar export --to megatron), or plan with precision fp8"
        )
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) < (8, 9):
            name = torch.cuda.get_device_name(device)
            raise RuntimeError(
                f"precision {recipe.name!r} needs FP8 tensor cores (compute capability 8.9 or "
                f"newer: Ada, Hopper, Blackwell); {name} has {major}.{minor}: train in bf16"
            )


def covered_linears(blocks: list[tuple[str, nn.Module]], recipe: Recipe) -> list[str]:
    """The paths of the linears ``recipe`` converts: every ``nn.Linear`` of the blocks it
    covers (all but `edge_blocks_in_bf16` at each end) whose dimensions FP8 GEMMs take."""
    keep = recipe.edge_blocks_in_bf16
    inner = blocks[keep : len(blocks) - keep] if len(blocks) > 2 * keep else []
    out = []
    for path, block in inner:
        for name, module in block.named_modules():
            if isinstance(module, nn.Linear) and _aligned(module):
                out.append(f"{path}.{name}" if name else path)
    return out


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
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    gather = recipe.fp8_all_gather and config.zero_stage == 3 and config.fsdp > 1
    ao_config = Float8LinearConfig.from_recipe_name(recipe.torchao_recipe)
    if gather:
        ao_config = replace(ao_config, enable_fsdp_float8_all_gather=True)
    paths = covered_linears(blocks, recipe)
    wanted = set(paths)
    convert_to_float8_training(
        model, config=ao_config, module_filter_fn=lambda _module, fqn: fqn in wanted
    )
    return LowPrecision(recipe.name, tuple(paths), gather, device.type == "cpu")


def _aligned(linear: nn.Linear) -> bool:
    return linear.in_features % _FP8_ALIGN == 0 and linear.out_features % _FP8_ALIGN == 0
