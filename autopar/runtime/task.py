"""What a training run trains: the model factory, its loss and its data, from a plan's record.

In: a `module:function` factory path and its JSON keyword arguments (as `Plan.model_source`
records them), optionally a `module:function` data hook. Out: a `Task` -- `build_meta()` makes
the model on the meta device (what each rank parallelises, then fills with only its shards:
`autopar.runtime.startup`), `build()` the whole model in one process with the weights every
plan starts from, `forward(model, inputs)` gives the outputs the loss reads,
`loss(outputs, targets)`, and `batch(step, start, stop)` the samples [start, stop) of step
`step`'s global batch.

Known factories:
    autopar.models.zoo:build   kwargs {"name": preset, **overrides}: the zoo's loss and inputs
    autopar.models.hf:build    kwargs {"name": preset, **overrides}: next-token loss on
                               `.logits`, seeded counting sequences (learnable) of the plan's
                               sequence length
    anything else              the user's factory; its output of any structure (a tensor, a
                               tuple, a dict, a Hugging Face ModelOutput: `.logits`) gives the
                               tensor the loss reads; next-token loss on random token ids when
                               the model's config has `vocab_size`, otherwise a data hook

Synthetic data: step `s`'s global batch is generated from seed `seed + s` alone, so every rank
(and the single-process reference) sees the same samples; a rank slices its own rows.

Loss: the plan's recorded `module:function` (or `--loss`) replaces the default, called as
`loss(outputs, targets) -> scalar` on the tensor the forward gives and the batch's targets.

Data hook: `--data module:fn` names `fn(step, start, stop) -> (inputs, targets)`, returning
samples [start, stop) of the step's global batch (inputs a tuple of tensors, batch first).

Public functions (the factory and fingerprint helpers come from `autopar.models.source`):
    task_from_source(factory, kwargs, seq_len=None, data=None, seed=0, loss=None) -> Task
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from autopar.models import zoo
from autopar.models.source import HF_FACTORY, ZOO_FACTORY, resolve_callable

Batch = tuple[tuple[torch.Tensor, ...], torch.Tensor]


@dataclass(frozen=True)
class Task:
    """A model to build, how to call it, its loss, and its data (see the module docstring)."""

    # the model on the meta device (no memory), as `autopar.runtime.startup` records it: a
    # factory that takes ``device`` is given "meta", any other runs under torch.device("meta")
    build_meta: Callable[[], nn.Module]
    forward: Callable[[nn.Module, tuple[torch.Tensor, ...]], torch.Tensor]
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    batch: Callable[[int, int, int], Batch]  # (step, start, stop)
    description: str = ""

    def build(self, seed: int = 0) -> nn.Module:
        """The whole model on the CPU with the weights every plan starts from under ``seed``
        (`startup.start.build_whole`: the factory's initialization replayed), for one process:
        reference runs and tests."""
        from autopar.runtime.startup.start import build_whole

        return build_whole(self, seed)


def _call(model: nn.Module, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
    return model(*inputs)


def _first_tensor(out: Any) -> torch.Tensor:
    """The tensor a loss reads from a model's output of any structure: a tensor itself, a
    Hugging Face ModelOutput's or a dict's ``logits`` (else its first value), a tuple's first
    element."""
    if isinstance(out, torch.Tensor):
        return out
    logits = getattr(out, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    if isinstance(out, dict):
        return _first_tensor(out["logits"] if "logits" in out else next(iter(out.values())))
    if isinstance(out, tuple | list) and out:
        return _first_tensor(out[0])
    raise TypeError(f"the model returned {type(out).__name__}, which holds no tensor to train on")


def _call_any(model: nn.Module, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
    return _first_tensor(model(*inputs))


def _logits(model: nn.Module, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
    return model(*inputs).logits


def task_from_source(
    factory: str,
    kwargs: dict[str, Any] | None = None,
    *,
    global_batch_size: int,
    seq_len: int | None = None,
    data: str | Callable[[int, int, int], Batch] | None = None,
    seed: int = 0,
    loss: str | Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
) -> Task:
    """The Task of a recorded model factory (see the module docstring).

    Args:
        factory: "module:function" returning the model.
        kwargs: its keyword arguments (JSON values).
        global_batch_size: samples per step (the synthetic generator makes this many).
        seq_len: token-id length for synthetic language-model data (the plan's).
        data: a data hook (callable or "module:fn"); replaces synthetic data.
        seed: synthetic data's base seed.
        loss: the user's loss ("module:function" or a callable), ``loss(outputs, targets)``
            -> scalar, replacing the factory's default.
    """
    kwargs = dict(kwargs or {})
    task = _task(factory, kwargs, global_batch_size, seq_len, data, seed)
    if loss is None:
        return task
    fn = resolve_callable(loss) if isinstance(loss, str) else loss
    _callable("--loss", loss, fn)
    return replace(task, loss=fn, description=f"{task.description}, loss {loss}")


def _callable(option: str, name: Any, fn: Any) -> None:
    if not callable(fn):
        raise ValueError(f"{option} {name}: a {type(fn).__name__}, not a function to call")


def _task(
    factory: str,
    kwargs: dict[str, Any],
    global_batch_size: int,
    seq_len: int | None,
    data: str | Callable[[int, int, int], Batch] | None,
    seed: int,
) -> Task:
    hook = resolve_callable(data) if isinstance(data, str) else data
    if hook is not None:
        _callable("--data", data, hook)
    if factory == ZOO_FACTORY:
        name = kwargs["name"]
        build_meta = _zoo_builder(kwargs)
        probe = _ConfigProbe(zoo.config(name, **_overrides(kwargs)))

        def zoo_batch(step: int, start: int, stop: int) -> Batch:
            inputs, targets = zoo.example_batch(
                name, probe, batch_size=global_batch_size, seq_len=seq_len, seed=seed + step
            )
            return tuple(t[start:stop] for t in inputs), targets[start:stop]

        loss = zoo.loss_fn(name)
        return Task(build_meta, _call, loss, hook or zoo_batch, f"zoo {name}")
    build_fn = resolve_callable(factory)
    takes_device = "device" in inspect.signature(build_fn).parameters

    def build_meta() -> nn.Module:
        if takes_device:  # its own device argument wins over a device context
            return build_fn(**{**kwargs, "device": "meta"})
        with torch.device("meta"):
            return build_fn(**kwargs)

    forward = _logits if factory == HF_FACTORY else _call_any
    if hook is not None:
        return Task(build_meta, forward, zoo.lm_loss, hook, factory)
    config = getattr(build_meta(), "config", None)
    vocab = getattr(config, "vocab_size", None)
    if vocab is None or seq_len is None:
        raise ValueError(
            f"no synthetic data for {factory}: its model has no config.vocab_size (or the plan "
            "no sequence length); pass a data hook (--data module:fn, fn(step, start, stop) -> "
            "(inputs, targets))"
        )
    batch = _token_batch(vocab, seq_len, global_batch_size, seed)
    return Task(build_meta, forward, zoo.lm_loss, batch, factory)


class _ConfigProbe(nn.Module):
    """What `zoo.example_batch` reads of a model -- its config and its device (the CPU) --
    without building the model."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config
        self.anchor = nn.Parameter(torch.zeros(()))


def _overrides(kwargs: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in kwargs.items() if k not in ("name", "seed", "device")}
    # JSON has no tuples: the zoo's tuple-valued fields (ConvNet channels) come back as lists
    return {k: tuple(v) if isinstance(v, list) else v for k, v in out.items()}


def _zoo_builder(kwargs: dict[str, Any]) -> Callable[[], nn.Module]:
    name, seed = kwargs["name"], int(kwargs.get("seed", 0))

    def build() -> nn.Module:
        return zoo.build(name, seed=seed, device="meta", **_overrides(kwargs))

    return build


def _token_batch(
    vocab: int, seq_len: int, global_batch_size: int, seed: int
) -> Callable[[int, int, int], Batch]:
    def batch(step: int, start: int, stop: int) -> Batch:
        # counting sequences from a random start and stride (token t+1 = token t + stride mod
        # vocab): learnable, so a run's loss visibly falls; uniform random tokens would keep
        # it at log(vocab) whatever the model does
        gen = torch.Generator().manual_seed(seed + step)
        first = torch.randint(0, vocab, (global_batch_size, 1), generator=gen)
        stride = torch.randint(1, 4, (global_batch_size, 1), generator=gen)
        ids = (first + stride * torch.arange(seq_len)) % vocab
        return (ids[start:stop],), ids[start:stop]

    return batch
