"""Training precisions: a dtype, or a low-precision recipe for the linear layers on BF16.

In: the ``precision`` a user, the CLI or a plan names. Out: `base_precision` (the dtype the
rest of the model, the gradients and the optimizer's copy run in) and `recipe_of` (the
`Recipe` whose matmuls run in FP8 or FP4, or None), and `check_recipe`, which refuses a recipe
the device cannot run with a message naming both.

A recipe converts the linear layers of the repeated blocks: their forward GEMM and both
backward GEMMs run at the device's ``gemm_dtype`` rate. Attention (its score and value
products), norms, the embedding and the output head stay in BF16, as torchao's
``convert_to_float8_training`` and TransformerEngine's recipes leave them; NVFP4 also keeps the
first and last blocks in BF16 (NVIDIA's NVFP4 pretraining recipe). What a recipe costs beside
its GEMMs is memory-bound: each GEMM operand is scaled (an amax reduction) and cast, and the
backward GEMMs need transposed copies. Those bytes are in ``cast_*`` as multiples of the BF16
bytes of the layer's activations and weights, priced like the other memory-bound ops at the
stack's `cast_traffic` (eager torchao runs the amax and the cast as two kernels; TransformerEngine
and torch.compile fuse them).

Invariant: every precision name the planner, a plan or a generated program accepts is in
`PRECISIONS`; a recipe's base is BF16.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

from autopar.errors import ConfigError

DTYPES = ("bf16", "fp16", "fp32")
T = TypeVar("T")
# torchao's MXFP8 block: 32 elements share one e8m0 scale along each GEMM operand's contracted
# dimension, the tokens included (the weight gradient contracts over them)
MX_BLOCK = 32
# the multiple a linear's dimensions must be for torchao to convert it: torch._scaled_mm takes
# FP8 operands whose dimensions are multiples of 16; MXFP8 scales blocks of 32 along each
_TORCHAO_ALIGN = {"fp8": 16, "mxfp8": MX_BLOCK}
# a linear layer as a recipe's coverage sees it: (in_features, out_features, has a bias)
Linear = tuple[int, int, bool]


@dataclass(frozen=True)
class Recipe:
    name: str
    gemm_dtype: str  # the key of the profile's device.peak_flops_per_s its GEMMs run at
    description: str
    # the converted GEMMs' achievable fraction of their peak against a BF16 GEMM's of its own
    # (the profile's matmul curve describes BF16): FP8 tensor cores keep fewer of their
    # nominal FLOPs busy, and rowwise scales cost the GEMM's epilogue more
    gemm_efficiency: float
    # bytes the scaling, casts and transposes move, per BF16 byte of the converted layers'
    # activations (inputs + outputs) and weights, forward and backward
    cast_forward: tuple[float, float]
    cast_backward: tuple[float, float]
    edge_blocks_in_bf16: int  # blocks at each end the recipe keeps in BF16
    # FSDP can gather the converted weights already cast (torchao's
    # enable_fsdp_float8_all_gather; tensorwise scales only): 1 byte per element, not 2
    fp8_all_gather: bool
    # torchao's name for it, or None: autopar's runtime does not run it. FP8 recipes:
    # Float8LinearConfig.from_recipe_name(...); MXFP8: an MXFP8TrainingRecipe value
    torchao_recipe: str | None
    source: str

    def covered(self, blocks: Sequence[T]) -> list[T]:
        """The ``blocks`` (in order) this recipe converts: all but `edge_blocks_in_bf16` at
        each end."""
        keep = self.edge_blocks_in_bf16
        return list(blocks[keep : len(blocks) - keep]) if len(blocks) > 2 * keep else []

    def torchao_converts(self, linear: Linear | None) -> bool:
        """Whether torchao's conversion (autopar's runtime, torchtitan) runs a covered block's
        ``linear`` in this recipe: an ``nn.Linear`` (None: another module, such as transformers'
        Conv1D) whose dimensions its GEMMs take; for MXFP8 without a bias (torchao's MXFP8
        weight drops ``F.linear``'s bias). TransformerEngine's modules run every linear."""
        if linear is None:
            return False
        in_features, out_features, biased = linear
        align = _TORCHAO_ALIGN.get(self.gemm_dtype, 16)
        aligned = not (in_features % align or out_features % align)
        return aligned and not (self.gemm_dtype == "mxfp8" and biased)


# Per GEMM Y = X W: forward scales X and W (read 2 B, amax) and casts them (read 2 B,
# write 1 B) when fused into one kernel: 3 B per BF16 element = 1.5 x their BF16 bytes, of
# which X is about half the layer's activation bytes (X and Y). Backward casts dY (1.5 x its
# bytes, the other half) and, for per-tensor scales on Hopper's K-major FP8 GEMMs, writes
# transposed FP8 copies of X, W and dY (read 1 B, write 1 B per element = 1 x BF16 bytes).
_TENSORWISE_CAST = ((0.75, 1.5), (1.75, 1.0))
RECIPES: dict[str, Recipe] = {
    r.name: r
    for r in (
        Recipe(
            "fp8-tensorwise",
            "fp8",
            "FP8 e4m3 linears, one dynamic scale per tensor (torchao tensorwise, "
            "TransformerEngine delayed/current scaling)",
            gemm_efficiency=1.0,
            cast_forward=_TENSORWISE_CAST[0],
            cast_backward=_TENSORWISE_CAST[1],
            edge_blocks_in_bf16=0,
            fp8_all_gather=True,
            torchao_recipe="tensorwise",
            source="gemm_efficiency: benchmarks/fp8_ratio.py --fit fp8-tensorwise over the 10 "
            "FP8 rows of data/published_grids.csv with a BF16 twin (torchtitan, llm-foundry + "
            "TransformerEngine): mean |log ratio error| 0.058 at 0.9, 0.038 at 1.0, 0.034 at "
            "1.05 (flat to 1.15); 1.0 kept: an FP8 GEMM at the BF16 GEMM's fraction of its "
            "own peak; cast bytes: the module docstring",
        ),
        Recipe(
            "fp8-rowwise",
            "fp8",
            "FP8 linears, one scale per row of each operand (torchao rowwise)",
            gemm_efficiency=0.89,
            cast_forward=_TENSORWISE_CAST[0],
            cast_backward=_TENSORWISE_CAST[1],
            edge_blocks_in_bf16=0,
            fp8_all_gather=False,
            torchao_recipe="rowwise",
            source="measured: torch._scaled_mm with per-row scales over per-tensor ones on an "
            "H100 (torch 2.11, CUDA 13.0), median 0.89 (0.87-0.99) over the 9 GEMMs of 137 "
            "GFLOP or more in data/measurements/h100_kernels_2026-11-26.json "
            "(benchmarks/gpu_kernels.py); times tensorwise's factor 1.0 (was 0.75, an estimate "
            "from torchao's float8 README)",
        ),
        Recipe(
            "mxfp8",
            "mxfp8",
            "MXFP8 linears, one e8m0 scale per 32 elements (Blackwell block scaling)",
            gemm_efficiency=1.0,
            cast_forward=(0.8, 1.6),
            cast_backward=(1.9, 1.1),
            edge_blocks_in_bf16=0,
            fp8_all_gather=False,
            torchao_recipe="mxfp8_rceil",
            source="as fp8-tensorwise, with a 1/32 scale per element written beside each cast",
        ),
        Recipe(
            "nvfp4",
            "nvfp4",
            "NVFP4 linears (e2m1, an fp8 scale per 16 elements), first and last block in BF16",
            gemm_efficiency=0.8,
            cast_forward=(0.7, 1.4),
            cast_backward=(1.9, 1.1),
            edge_blocks_in_bf16=1,
            fp8_all_gather=False,
            torchao_recipe=None,
            source="estimate: NVIDIA's NVFP4 pretraining recipe (arXiv 2509.25149) keeps the "
            "first and last blocks in BF16 and applies random Hadamard transforms to the "
            "weight-gradient GEMM's inputs",
        ),
    )
}
ALIASES = {"fp8": "fp8-tensorwise"}
PRECISIONS = (*DTYPES, *RECIPES, *ALIASES)


def canonical(precision: str) -> str:
    """``precision`` with an alias resolved ("fp8" is "fp8-tensorwise").

    Raises:
        ConfigError: an unknown precision (the message lists the known ones).
    """
    name = ALIASES.get(precision, precision)
    if name not in DTYPES and name not in RECIPES:
        raise ConfigError(
            f"precision must be one of {', '.join(PRECISIONS)} (or 'auto' to plan), "
            f"got {precision!r}"
        )
    return name


def recipe_of(precision: str) -> Recipe | None:
    """The low-precision recipe ``precision`` names, or None for a plain dtype."""
    return RECIPES.get(canonical(precision))


def base_precision(precision: str) -> str:
    """The dtype everything a recipe leaves alone runs in: BF16 under a recipe."""
    name = canonical(precision)
    return "bf16" if name in RECIPES else name


def check_recipe(recipe: Recipe, profile_name: str, device_name: str, kind: str, peaks) -> None:
    """Refuse ``recipe`` on a device without tensor cores for its GEMM format.

    Raises:
        ConfigError: naming the recipe, the device and what it has.
    """
    if _runs_on(recipe, kind, peaks):
        return
    has = ", ".join(sorted(peaks))
    why = "TPUs and CPUs have no FP8/FP4 training GEMMs here" if kind != "gpu" else (
        f"it has no {recipe.gemm_dtype} tensor cores (peak FLOP/s given for {has})"
    )  # fmt: skip
    raise ConfigError(
        f"precision {recipe.name!r} ({recipe.description}) cannot run on {profile_name} "
        f"({device_name}): {why}; use bf16, or a profile whose device.peak_flops_per_s "
        f"lists {recipe.gemm_dtype}"
    )


def supported_recipes(kind: str, peaks) -> list[Recipe]:
    """The recipes a device of this kind with these peak rates can run."""
    return [r for r in RECIPES.values() if _runs_on(r, kind, peaks)]


def _runs_on(recipe: Recipe, kind: str, peaks) -> bool:
    """A GPU whose profile gives a peak rate for the recipe's GEMM format."""
    return kind == "gpu" and recipe.gemm_dtype in peaks
