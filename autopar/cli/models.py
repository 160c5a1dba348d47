"""Which model a command means: a zoo name, a Hugging Face preset, a config.json or
``module:factory``; and the same model again from a saved plan's `model_source`.

In: the user's model argument (and the sequence length to plan for). Out: `LoadedModel`, the
module on the meta device (nothing allocated), one sample's inputs and the factory a plan
records so that `compare`, `generate` and the generated program can build the model again.
Resolution order: zoo name, Hugging Face preset, a checkpoint directory (its config.json), a
path to a ``.json`` file, ``module:function``.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autopar.errors import AutoparError
from autopar.models.source import HF_CONFIG_FACTORY


@dataclass(frozen=True)
class LoadedModel:
    model: Any  # torch.nn.Module
    inputs: tuple[Any, ...]
    factory: tuple[str, dict[str, Any]] | None  # None: the model records its own
    description: str


def load_model(spec: str, seq_len: int | None = None) -> LoadedModel:
    """Build the model ``spec`` names on the meta device, with one sample's inputs.

    Raises:
        AutoparError: ``spec`` names no model (the message lists what it tried), or the
            factory or config fails.
    """
    from autopar.models import hf, zoo

    if spec in zoo.PRESETS:
        model = _call(zoo.build, spec, device="meta")
        lm = hasattr(model.config, "seq_len")  # MLP and ConvNet take no sequence
        inputs = zoo.example_inputs(spec, model, seq_len=seq_len if lm else None)
        return LoadedModel(model, inputs, None, f"zoo model {spec}")
    if spec in hf.names():
        model = _call(hf.build, spec, device="meta")
        inputs = hf.example_inputs(spec, model, seq_len=seq_len)
        return LoadedModel(model, inputs, None, f"Hugging Face preset {spec}")
    if Path(spec).is_dir() and (Path(spec) / "config.json").is_file():
        spec = str(Path(spec) / "config.json")  # a Hugging Face checkpoint directory
    if spec.endswith(".json") or Path(spec).is_file():
        path = str(Path(spec).resolve())
        model = hf.build_from_config(path, device="meta")
        factory = (HF_CONFIG_FACTORY, {"path": path})
        return LoadedModel(model, _token_ids(model, seq_len), factory, f"config {spec}")
    if ":" in spec:
        model = _call(_resolve(spec))
        return LoadedModel(model, _token_ids(model, seq_len), (spec, {}), f"factory {spec}")
    raise AutoparError(
        f"unknown model {spec!r}: not a zoo model ({', '.join(zoo.names())}), not a Hugging "
        f"Face preset ({', '.join(hf.names())}), not a config.json path or a directory holding "
        "one, not module:factory (see `autopar list-models`)"
    )


def model_from_plan(plan: Any, trust_factory: bool = False) -> LoadedModel:
    """The plan's model again (on meta), from its recorded factory, with inputs of its length
    (`autopar.plan.rebuild`); a factory that is not autopar's own runs only with
    ``trust_factory`` (``--trust-factory``).

    Raises:
        AutoparError: the plan records no factory, it no longer builds, it builds a model
            with another fingerprint, or its factory is not trusted.
    """
    from autopar.plan.rebuild import rebuild_model, sample_inputs

    model = rebuild_model(plan, trust_factory=trust_factory)
    source = plan.model_source
    return LoadedModel(
        model, sample_inputs(plan, model), (source.factory, dict(source.kwargs)), source.as_text()
    )


def _token_ids(model: Any, seq_len: int | None) -> tuple[Any, ...]:
    from autopar.tracing.inputs import infer_example_inputs

    if seq_len is None:
        try:
            return infer_example_inputs(model)
        except ValueError as e:
            raise AutoparError(f"{e}; or give --seq-len") from None
    import torch

    device = next(model.parameters()).device
    return (torch.zeros(1, seq_len, dtype=torch.long, device=device),)


def _resolve(path: str) -> Any:
    module_name, _, attr = path.partition(":")
    try:
        module = importlib.import_module(module_name)
        return getattr(module, attr)
    except (ImportError, AttributeError) as e:
        raise AutoparError(f"cannot import model factory {path!r}: {e}") from None


def _call(fn: Any, *args: Any, **kwargs: Any) -> Any:
    try:
        return fn(*args, **kwargs)
    except AutoparError:
        raise
    except (ValueError, TypeError, ImportError, RuntimeError) as e:
        raise AutoparError(f"building the model failed: {e}") from None


def list_models() -> str:
    """The zoo's and the Hugging Face presets' names, each with where its shape comes from."""
    from autopar.models import hf, zoo

    lines = ["zoo (autopar.models.zoo):"]
    lines += [f"  {n:<20} {zoo.preset(n).source}" for n in zoo.names()]
    lines += ["Hugging Face presets (autopar.models.hf, built from configs, no download):"]
    lines += [f"  {n:<20} {hf.preset(n).source}" for n in hf.names()]
    lines.append("or: a path to a Hugging Face config.json, or module:factory")
    return "\n".join(lines)


def run_list_models(_args: object) -> str:
    return list_models()
