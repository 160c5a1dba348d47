"""Exporters: a Plan as the configuration of the framework people already train with.

    torchtitan.py   torchtitan's job TOML (its ConfigManager loads it)
    megatron.py     Megatron-LM / NeMo arguments for pretrain_gpt.py, as a bash array
    deepspeed.py    a DeepSpeed config JSON
    accelerate.py   an Accelerate FSDP2 config YAML
    common.py       the result (`Exported`), the header, the model's shape, value formats

In: a Plan, optionally the model's shape (`model_shape` of its config: what Megatron needs to
build the model) and the plan re-priced on the target's stack (`Priced`). Out: an `Exported`:
the file's text and name, and what the target cannot express (also written into the file as
comments). `autopar.api.export` rebuilds the model and re-prices; this layer only renders.

Invariant: rendering is deterministic, and every decision the target cannot take as planned
is named in `Exported.gaps`, never dropped silently.
"""

from __future__ import annotations

from collections.abc import Callable

from autopar.codegen.export.accelerate import export_accelerate
from autopar.codegen.export.common import Exported, ModelShape, Priced, model_shape
from autopar.codegen.export.deepspeed import export_deepspeed
from autopar.codegen.export.megatron import export_megatron
from autopar.codegen.export.torchtitan import export_torchtitan
from autopar.plan.types import Plan

# target -> (renderer, the software stack (`autopar.estimate.stacks`) that prices it)
TARGETS: dict[str, tuple[Callable[[Plan, ModelShape | None, Priced | None], Exported], str]] = {
    "torchtitan": (export_torchtitan, "torchtitan"),
    "megatron": (export_megatron, "megatron-core"),
    "deepspeed": (export_deepspeed, "deepspeed"),
    # eager PyTorch with FSDP2 on the user's model: what autopar's own runtime is priced as
    "accelerate": (export_accelerate, "autopar"),
}


def export_plan(
    plan: Plan, target: str, shape: ModelShape | None = None, priced: Priced | None = None
) -> Exported:
    """Render ``plan`` for ``target`` (one of `TARGETS`).

    Raises:
        ValueError: an unknown target.
    """
    if target not in TARGETS:
        raise ValueError(f"no exporter for {target!r}: choose one of {', '.join(TARGETS)}")
    return TARGETS[target][0](plan, shape, priced)


__all__ = ["TARGETS", "Exported", "ModelShape", "Priced", "export_plan", "model_shape"]
