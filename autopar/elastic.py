"""Elastic re-plan (`autopar.replan`): a saved Plan + a new cluster size -> a Plan for it.

In: a `Plan` that records its model factory (`plan.model_source`), and the new size (nodes of
the plan's profile, and/or total devices). Out: a new `Plan` -- the same model (rebuilt on the
meta device from the factory: no memory), the same global batch, precision and optimizer,
planned by `autopar.parallelize` (or priced by `autopar.evaluate` for a config you give) on the
same hardware profile with the new device count. Its notes say what it was re-planned from.

A run resumes under the new plan from a checkpoint saved under the old one: checkpoints hold
the state by full parameter name (`autopar.runtime.checkpoint`), and torch.distributed.
checkpoint reshards it on load. The step is kept, because the global batch is.

Invariant: the rebuilt model has the plan's fingerprint (parameter names and shapes);
otherwise the factory changed since the plan was made and re-planning refuses.

Public functions:
    replan(plan, *, num_nodes=None, num_devices=None, config=None, options=None,
           example_inputs=None, profile=None) -> Plan
    run_replan(args) -> str          # `autopar replan plan.json --num-nodes N -o DIR`
"""

from __future__ import annotations

import argparse
import inspect
from dataclasses import replace
from pathlib import Path
from typing import Any

from autopar.config import ParallelConfig
from autopar.errors import AutoparError


class ReplanError(AutoparError, ValueError):
    """The plan cannot be re-planned: no model factory, a changed model, no size given."""


def _cluster(plan: Any, num_nodes: int | None, num_devices: int | None, profile: str | None):
    from autopar.cluster import Cluster

    name = profile or plan.cluster
    if num_nodes is None and num_devices is None:
        raise ReplanError("replan needs num_nodes or num_devices (the new cluster's size)")
    if num_nodes is None:
        return Cluster.from_profile(name, num_devices=num_devices)
    if num_devices is None:  # keep the plan's node shape
        per_node = max(1, plan.world_size // max(1, plan.num_nodes))
        return Cluster.from_profile(name, num_nodes, devices_per_node=per_node)
    if num_devices % num_nodes:
        raise ReplanError(
            f"num_devices={num_devices} is not a multiple of num_nodes={num_nodes} "
            "(devices per node must be equal)"
        )
    return Cluster.from_profile(name, num_nodes, devices_per_node=num_devices // num_nodes)


def _meta_model(plan: Any) -> Any:
    """The plan's model, rebuilt from its factory on the meta device (no memory)."""
    import torch

    from autopar.runtime.task import model_fingerprint, resolve_callable

    source = plan.model_source
    if source is None:
        raise ReplanError(
            f"the plan of {plan.model} records no model factory, so its model cannot be "
            "rebuilt: plan it with model_factory='module:function' (zoo and Hugging Face "
            "models record theirs)"
        )
    factory = resolve_callable(source.factory)
    kwargs = dict(source.kwargs)
    if "device" in inspect.signature(factory).parameters:
        kwargs["device"] = "meta"
    with torch.device("meta"):
        model = factory(**kwargs)
    got = model_fingerprint(model)
    if got != source.fingerprint:
        raise ReplanError(
            f"{source.factory} now builds a model with fingerprint {got}, but the plan was "
            f"made for fingerprint {source.fingerprint} (other parameter names or shapes): "
            "plan the new model from scratch"
        )
    return model


def _inputs(plan: Any, model: Any) -> tuple:
    import torch

    from autopar.runtime.task import ZOO_FACTORY

    source = plan.model_source
    if source.factory == ZOO_FACTORY:
        from autopar.models import zoo

        return zoo.example_inputs(source.kwargs["name"], model, seq_len=plan.seq_len)
    if getattr(getattr(model, "config", None), "vocab_size", None) is None:
        raise ReplanError(
            f"cannot infer one sample's inputs for {source.factory}: pass example_inputs"
        )
    return (torch.zeros(1, plan.seq_len, dtype=torch.long, device="meta"),)


def replan(
    plan: Any,
    *,
    num_nodes: int | None = None,
    num_devices: int | None = None,
    config: ParallelConfig | None = None,
    options: Any = None,
    example_inputs: Any = None,
    profile: str | None = None,
) -> Any:
    """Plan ``plan``'s model again for a smaller or larger cluster of the same profile.

    Args:
        plan: a Plan with a model factory (`plan.model_source`).
        num_nodes: nodes of the plan's profile (devices per node as in the plan).
        num_devices: total devices (with ``num_nodes``: devices per node = the quotient).
        config: price this config (`autopar.evaluate`) instead of searching.
        options: `PlanOptions` for the search (or `CostOptions` with ``config``).
        example_inputs: one sample's inputs, for a factory that is neither zoo nor a
            language model with `config.vocab_size`.
        profile: a profile .toml path when the plan's profile is not a shipped name.

    Returns:
        The new Plan (same model, global batch, precision, optimizer), its notes naming the
        plan it replaces.

    Raises:
        ReplanError: no factory, a changed model, no size given.
        ConfigError / InfeasibleError: ``config`` does not fit, or nothing fits.

    Example:
        >>> small = replan(plan, num_devices=2)     # doctest: +SKIP
        >>> small.save("out-2/")                    # resume with --checkpoint-dir as before
    """
    from autopar.api import evaluate, parallelize

    cluster = _cluster(plan, num_nodes, num_devices, profile)
    model = _meta_model(plan)
    inputs = example_inputs if example_inputs is not None else _inputs(plan, model)
    source = plan.model_source
    common = dict(
        global_batch_size=plan.global_batch_size,
        precision=plan.precision,
        optimizer=plan.optimizer,
        options=options,
        model_factory=(source.factory, source.kwargs),
    )
    if config is not None:
        new = evaluate(model, cluster, config, inputs, **common)
    else:
        new = parallelize(model, cluster, inputs, **common)
    note = (
        f"re-planned from {plan.config.as_text()} on {plan.world_size} devices "
        f"({plan.num_nodes} node(s)); a checkpoint saved under that plan resumes under this one"
    )
    return replace(new, notes=(*new.notes, note))


def run_replan(args: argparse.Namespace) -> str:
    """`autopar replan plan.json --num-nodes N [--num-devices N] [--config k=v,...] -o DIR`:
    the new plan.json and its train.py in DIR; prints the new plan's summary."""
    from autopar.commands.compare import parse_config
    from autopar.commands.plan_verb import load_plan

    plan = load_plan(args.plan)
    config = parse_config(args.config) if args.config else None
    new = replan(
        plan,
        num_nodes=args.num_nodes,
        num_devices=args.num_devices,
        config=config,
        profile=args.profile,
    )
    path = new.save(Path(args.out))
    written = [str(path)] + ([str(path.parent / "train.py")] if new.model_source else [])
    if args.json:
        return new.to_json()
    return new.summary() + "\n\nwrote " + ", ".join(written)
