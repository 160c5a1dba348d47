"""What a saved plan rebuilds: its model, one sample's inputs, and its cluster at a new size.

In: a `Plan` that records its model factory (`plan.model_source`), and for the cluster the new
size (nodes of the plan's profile and/or total devices). Out: the model built again on the
meta device (no memory), inputs of the plan's sequence length, and a `Cluster` of the plan's
profile. `autopar.api.replan` plans the model again from these; `autopar compare` prices a
config beside the saved plan with them.

Invariant: the rebuilt model has the plan's fingerprint (parameter names and shapes); otherwise
the factory changed since the plan was made, and rebuilding refuses.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from autopar.errors import AutoparError
from autopar.hardware import Cluster
from autopar.hardware.cluster import priced_sites
from autopar.models.source import (
    HF_FACTORY,
    ZOO_FACTORY,
    build_from_source,
    model_fingerprint,
)

if TYPE_CHECKING:
    from torch import nn

    from autopar.plan.types import Plan


class ReplanError(AutoparError, ValueError):
    """The plan cannot be re-planned: no model factory, a changed model, no size given."""


def rebuild_model(plan: Plan, *, trust_factory: bool = False) -> nn.Module:
    """The plan's model from its recorded factory, on the meta device, checked against the
    recorded fingerprint.

    Raises:
        ReplanError: no factory recorded, the factory fails, or it builds another model.
        UntrustedFactoryError: a factory that is not autopar's own, in a plan read from a
            file, without ``trust_factory`` (nothing is imported).
    """
    source = plan.model_source
    if source is None:
        raise ReplanError(
            f"the plan of {plan.model} records no model factory, so its model cannot be "
            "rebuilt: plan it with model_factory='module:function' (zoo and Hugging Face "
            "models record theirs; `autopar plan` records a config.json or module:factory)"
        )
    try:
        trusted = trust_factory or plan.trusted_factory
        model = build_from_source(source.factory, source.kwargs, device="meta", trusted=trusted)
    except AutoparError:
        raise
    except (ValueError, TypeError, ImportError, RuntimeError) as e:
        raise ReplanError(f"building the model from {source.factory} failed: {e}") from None
    got = model_fingerprint(model)
    if got != source.fingerprint:
        raise ReplanError(
            f"{source.factory} now builds a model with fingerprint {got}, but the plan was "
            f"made for fingerprint {source.fingerprint} (other parameter names or shapes): "
            "plan the new model from scratch"
        )
    return model


def sample_inputs(plan: Plan, model: nn.Module) -> tuple[Any, ...]:
    """One sample's inputs for ``model`` at the plan's sequence length: the zoo's and the
    Hugging Face presets' own, else token ids for a model whose config has `vocab_size`.

    Raises:
        ReplanError: the factory is none of these and its model has no `config.vocab_size`.
    """
    import torch

    source = plan.model_source
    assert source is not None, "rebuild_model refuses a plan without a factory first"
    name = source.kwargs.get("name")
    if source.factory == ZOO_FACTORY:
        from autopar.models import zoo

        language = hasattr(model.config, "seq_len")  # the MLP and ConvNet take no sequence
        return zoo.example_inputs(name, model, seq_len=plan.seq_len if language else None)
    if source.factory == HF_FACTORY:
        from autopar.models import hf

        return hf.example_inputs(name, model, seq_len=plan.seq_len)
    if getattr(getattr(model, "config", None), "vocab_size", None) is None:
        raise ReplanError(
            f"cannot infer one sample's inputs for {source.factory}: pass example_inputs"
        )
    return (torch.zeros(1, plan.seq_len, dtype=torch.long, device="meta"),)


def resized_cluster(
    plan: Plan, num_nodes: int | None, num_devices: int | None, profile: str | None = None
) -> Cluster:
    """The plan's profile (or ``profile``, a .toml path) with ``num_nodes`` nodes and/or
    ``num_devices`` devices in all; given nodes only, each keeps the plan's devices per node.
    A plan priced over several sites (its training record) keeps them: the same sites, link
    and latency, the size given being the whole cluster's (for a DiLoCo plan, which is one
    site's, too).

    Raises:
        ReplanError: no size given, or devices not a multiple of nodes.
        ProfileError: the size does not split over the plan's sites.
    """
    sites = priced_sites(plan.training, own=False)
    cluster = _sized(plan, num_nodes, num_devices, profile)
    return cluster.over_sites(*sites) if sites[0] > 1 else cluster


def _sized(
    plan: Plan, num_nodes: int | None, num_devices: int | None, profile: str | None
) -> Cluster:
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


def replanned_note(plan: Plan) -> str:
    """The note a re-planned plan carries about the plan it replaces."""
    return (
        f"re-planned from {plan.config.as_text()} on {plan.world_size} devices "
        f"({plan.num_nodes} node(s)); a checkpoint saved under that plan resumes under this one"
    )
