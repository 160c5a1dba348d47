"""Software stacks: what runs a plan, as data the cost model prices.

In: a stack's name (``"torchtitan"``) or a path to a TOML file in the format below. Out: a
frozen `Stack` whose `options` is the `CostOptions` the estimator prices with: the stack's
kernels against the profile's efficiency curves (matmul, attention, the traffic of the
memory-bound ops), the activation and loss memory its kernels keep, the allocator's reserve,
and the overlaps it performs (FSDP prefetch, TP communication, gradient reduction,
parameter gathers). Every table names its source; a number fitted to published runs says
which (benchmarks/published_grids.py prints the fit's rows).

Shipped stacks live in ``hardware_profiles/stacks/``; `stack_names()` lists them. The
default is ``autopar``: autopar's own runtime, PyTorch eager, the stack the generated programs
run and the one `parallelize` prices for unless told otherwise.

Format (schema_version 1; every key of a table but ``source`` may be left out, taking
`CostOptions`' default)::

    schema_version = 1
    name = "torchtitan"                 # the file stem
    description = "..."
    [kernels]    matmul_efficiency, attention_efficiency, memory_traffic, cast_traffic,
                 recipe_host_s, optimizer_fused, source
    [memory]     activation_factor, logit_copies, logit_fp32_copies,
                 loss_parallel_fp32_copies, grads_freed_each_step,
                 loss_apart_from_recompute, autocast_weight_bytes,
                 reserve_fraction, vocab_parallel_with_cp,
                 pipeline_sends_sequence_shards, sequence_parallel_saves_gathered,
                 moment_bytes, recompute_up_projections, fused_kernel_activations, source
    [overlap]    tp_comm_overlap, async_tp_overlap, overlap_grad_reduce,
                 replicated_grad_overlap, overlap_param_gather, fsdp_prefetch, offload_overlap,
                 fsdp_per_tensor, fsdp_list_copies, grad_bytes, comm_interference,
                 fp8_all_gather, param_hook_s, param_fetch_hook_s, fsdp_over_cp,
                 pp_keeps_unsharded, pipeline_blocking_sends, source
    [precision]  recipes (the low-precision recipes the stack trains, `config.precision`
                 names; without it, every recipe), torchao_linears (the recipe runs only
                 the linears torchao converts), source; optional: without it, every recipe
                 on every linear

Invariant: a stack that loads gives a valid CostOptions; errors name the file and the field.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from importlib import resources
from pathlib import Path
from typing import Any

import tomllib

from autopar.errors import ProfileError
from autopar.estimate.options import CostOptions

DEFAULT_STACK = "autopar"
_TABLES = {
    "kernels": (
        "matmul_efficiency",
        "attention_efficiency",
        "memory_traffic",
        "cast_traffic",
        "recipe_host_s",
        "optimizer_fused",
    ),
    "memory": (
        "activation_factor",
        "logit_copies",
        "logit_fp32_copies",
        "loss_parallel_fp32_copies",
        "grads_freed_each_step",
        "loss_apart_from_recompute",
        "autocast_weight_bytes",
        "reserve_fraction",
        "vocab_parallel_with_cp",
        "pipeline_sends_sequence_shards",
        "sequence_parallel_saves_gathered",
        "moment_bytes",
        "recompute_up_projections",
        "fused_kernel_activations",
    ),
    "overlap": (
        "tp_comm_overlap",
        "async_tp_overlap",
        "overlap_grad_reduce",
        "replicated_grad_overlap",
        "overlap_param_gather",
        "fsdp_prefetch",
        "offload_overlap",
        "fsdp_per_tensor",
        "fsdp_list_copies",
        "grad_bytes",
        "comm_interference",
        "fp8_all_gather",
        "param_hook_s",
        "param_fetch_hook_s",
        "fsdp_over_cp",
        "pp_keeps_unsharded",
        "pipeline_blocking_sends",
    ),
}


class StackError(ProfileError):
    """A software stack is unknown, or its file is malformed."""


@dataclass(frozen=True)
class Stack:
    name: str
    description: str
    options: CostOptions
    sources: dict[str, str]
    recipes: tuple[str, ...] | None = None  # None: every recipe (no [precision] table)

    def as_text(self) -> str:
        o = self.options
        return (
            f"{self.name}: {self.description}\n"
            f"  kernels  matmul x{o.matmul_efficiency:g}, attention x{o.attention_efficiency:g}, "
            f"memory-bound traffic x{o.memory_traffic:g}\n"
            f"  memory   activations x{o.activation_factor:g}, {o.logit_copies:g} logit copies "
            f"+ {o.logit_fp32_copies:g} in fp32 at the loss "
            f"(+ {o.loss_parallel_fp32_copies:g} under loss_parallel), "
            f"gradients {'freed' if o.grads_freed_each_step else 'kept'} between steps, "
            f"reserve {o.reserve_fraction:.0%}\n"
            f"  overlap  tp {o.tp_comm_overlap:g}, grad reduce {o.overlap_grad_reduce}, param "
            f"gather {o.overlap_param_gather}, fsdp prefetch {o.fsdp_prefetch}, compute lost "
            f"to hidden communication {o.comm_interference:.0%}, pipeline sends "
            f"{'held by the sender' if o.pipeline_blocking_sends else 'beside the next task'}"
        )


def stack_names() -> list[str]:
    """Names of the stacks that ship with autopar, sorted."""
    root = resources.files("hardware_profiles") / "stacks"
    return sorted(p.name[: -len(".toml")] for p in root.iterdir() if p.name.endswith(".toml"))


def load_stack(name_or_path: str | Path) -> Stack:
    """A shipped stack by name, or any stack TOML by path.

    Raises:
        StackError: unknown name (the message lists the shipped ones), or a bad field.
    """
    path = Path(name_or_path)
    if path.suffix == ".toml" or path.parent != Path("."):
        if not path.is_file():
            raise StackError(f"{path}: no such stack file")
        text, origin = path.read_text(encoding="utf-8"), str(path)
    else:
        resource = resources.files("hardware_profiles") / "stacks" / f"{name_or_path}.toml"
        if not resource.is_file():
            raise StackError(
                f"unknown software stack {str(name_or_path)!r}; shipped stacks: "
                f"{', '.join(stack_names())} (or give a path to a .toml file)"
            )
        text, origin = resource.read_text(encoding="utf-8"), str(resource)
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise StackError(f"{origin}: not valid TOML: {e}") from None
    return _parse(data, origin, Path(origin).stem)


def default_cost_options(**changes: Any) -> CostOptions:
    """The default stack's CostOptions (autopar's own runtime), with ``changes``."""
    return replace(load_stack(DEFAULT_STACK).options, **changes)


def stack_options(
    stack: str | Path | None, options: CostOptions | None, *, default: CostOptions | None = None
) -> CostOptions:
    """The CostOptions to price with: ``stack``'s, or ``options``, or ``default``.

    Raises:
        StackError: both a stack and options given (say which: options of a stack with a
            change are ``dataclasses.replace(load_stack(name).options, ...)``).
    """
    if stack is not None and options is not None:
        raise StackError(
            f"give stack={str(stack)!r} or options, not both: for a stack with a change, pass "
            f"options=dataclasses.replace(load_stack({str(stack)!r}).options, ...)"
        )
    if stack is not None:
        return load_stack(stack).options
    return options or default or load_stack(DEFAULT_STACK).options


def _parse(data: dict[str, Any], origin: str, stem: str) -> Stack:
    def fail(field: str, problem: str) -> StackError:
        return StackError(f"{origin}: field {field}: {problem}")

    if data.get("schema_version") != 1:
        raise fail("schema_version", f"must be 1, got {data.get('schema_version')!r}")
    if data.get("name") != stem:
        raise fail("name", f"must equal the file stem {stem!r}, got {data.get('name')!r}")
    if not isinstance(data.get("description"), str):
        raise fail("description", "must be a string")
    known = {f.name: f for f in fields(CostOptions)}
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for table, keys in _TABLES.items():
        section = data.get(table)
        if not isinstance(section, dict):
            raise fail(table, "missing table")
        if not isinstance(section.get("source"), str) or not section["source"]:
            raise fail(f"{table}.source", "must name where the numbers come from")
        sources[table] = section["source"]
        for key, value in section.items():
            if key == "source":
                continue
            if key not in keys:
                raise fail(f"{table}.{key}", f"unknown; known: {', '.join(keys)}")
            kind = type(getattr(CostOptions(), known[key].name))
            ok = isinstance(value, bool) if kind is bool else (
                isinstance(value, int | float) and not isinstance(value, bool)
                and math.isfinite(value)
            )  # fmt: skip
            if not ok:
                raise fail(f"{table}.{key}", f"must be a finite {kind.__name__}, got {value!r}")
            values[key] = kind(value) if kind is not bool else value
    try:
        options = replace(CostOptions(), stack=stem, **values)
    except ValueError as e:
        raise fail("(values)", str(e)) from None
    recipes, torchao = _precision(data.get("precision"), fail)
    if "precision" in data:
        sources["precision"] = data["precision"]["source"]
        options = replace(options, torchao_linears=torchao)
    return Stack(stem, data["description"], options, sources, recipes)


def _precision(section: Any, fail: Any) -> tuple[tuple[str, ...] | None, bool]:
    """The [precision] table's recipes (checked against `config.precision.RECIPES`; None:
    every one) and its torchao_linears (False when not given)."""
    from autopar.config.precision import RECIPES

    if section is None:
        return None, False
    if not isinstance(section, dict) or not isinstance(section.get("source"), str):
        raise fail("precision.source", "must name where the recipes come from")
    unknown = set(section) - {"recipes", "torchao_linears", "source"}
    if unknown:
        raise fail(
            f"precision.{sorted(unknown)[0]}", "unknown; known: recipes, torchao_linears, source"
        )
    torchao = section.get("torchao_linears", False)
    if not isinstance(torchao, bool):
        raise fail("precision.torchao_linears", f"must be a bool, got {torchao!r}")
    if "recipes" not in section:
        return None, torchao
    recipes = section["recipes"]
    if not isinstance(recipes, list) or any(r not in RECIPES for r in recipes):
        raise fail("precision.recipes", f"must be a list of {', '.join(RECIPES)}; got {recipes!r}")
    return tuple(recipes), torchao
