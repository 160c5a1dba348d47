"""Capture: an nn.Module and one sample's inputs -> a torch.export ExportedProgram.

`torch.export.export(strict=False)` traces with fake tensors, so a model built on the meta device
is captured without allocating its weights. The model is put in training mode for the capture
(dropout and friends appear as they will in training), without a key/value cache, and given
back as it was.
When export fails, the model is run once more, eagerly under a FakeTensorMode with module hooks,
to find the op and module path that failed, and the error says both (torch's own log of the
failure is kept quiet, and the partial graph it prints to stderr left out: the error is its
one line).
"""

from __future__ import annotations

import contextlib
import io
import sys
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from autopar.errors import AutoparError
from autopar.models.quiet import quiet_fake_tensors


class TraceError(AutoparError, RuntimeError):
    """The model could not be captured; the message names the op and the module path."""


def capture(model: nn.Module, example_inputs: tuple[Any, ...]) -> torch.export.ExportedProgram:
    """Export ``model`` on ``example_inputs`` (one sample) to an aten-level graph.

    Raises:
        TraceError: export failed; the message names the failing op and module where found.
    """
    if not isinstance(example_inputs, tuple):
        example_inputs = (example_inputs,)
    with _training_mode(model), _without_stack_traces(), quiet_fake_tensors():
        written = io.StringIO()
        try:
            with contextlib.redirect_stderr(written):
                program = torch.export.export(model, example_inputs, strict=False)
        except Exception as export_error:
            _replay(written.getvalue(), getattr(export_error, "partial_fx_graph", None))
            where = _locate_failure(model, example_inputs)
            first_line = str(export_error).strip().splitlines()[0][:300]
            raise TraceError(
                f"cannot trace {type(model).__name__}: {where or 'no single op found'}; "
                f"torch.export said: {type(export_error).__name__}: {first_line}"
            ) from export_error
        _replay(written.getvalue())
        return program


def _replay(text: str, partial_graph: str | None = None) -> None:
    """What torch wrote to stderr while exporting, written there again, less the partial
    graph it prints on a data-dependent failure (hundreds of lines of aten ops; the error
    names the op and the module instead)."""
    if partial_graph:
        text = text.replace(f"{partial_graph}\n", "")
    if text.strip():
        sys.stderr.write(text)


@contextlib.contextmanager
def _without_stack_traces() -> Iterator[None]:
    """No Python stack trace recorded on each node: the planner never reads
    ``node.meta["stack_trace"]``, and extracting and symbolizing one per op was a quarter of
    a capture (Llama 3 8B: 3.8 s -> 2.8 s). A torch whose torch.fx.config lacks the switch
    records them as before."""
    config = getattr(torch.fx, "config", None)
    if config is None or not hasattr(config, "do_not_emit_stack_traces"):
        yield
        return
    was = config.do_not_emit_stack_traces
    config.do_not_emit_stack_traces = True
    try:
        yield
    finally:
        config.do_not_emit_stack_traces = was


@contextlib.contextmanager
def _training_mode(model: nn.Module) -> Iterator[None]:
    """Training mode, and no key/value cache: a Hugging Face model built by the user keeps
    `config.use_cache=True`, whose DynamicCache output torch.export cannot flatten, and
    training never reads the cache."""
    was_training = model.training
    config = getattr(model, "config", None)
    cached = getattr(config, "use_cache", None)
    model.train()
    if cached:
        config.use_cache = False
    try:
        yield
    finally:
        model.train(was_training)
        if cached:
            config.use_cache = cached


def _locate_failure(model: nn.Module, example_inputs: tuple[Any, ...]) -> str | None:
    """Re-run the forward eagerly on fake tensors and report the op and module that raise."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    stack: list[str] = []
    names = {m: n for n, m in model.named_modules()}

    def enter(module: nn.Module, _args: Any) -> None:
        stack.append(names[module])

    def leave(_module: nn.Module, _args: Any, _out: Any) -> None:
        stack.pop()  # a hook that returns a value would replace the module's output

    hooks = [m.register_forward_pre_hook(enter) for m in names]
    hooks += [m.register_forward_hook(leave) for m in names]
    try:
        with FakeTensorMode(allow_non_fake_inputs=True) as fake_mode:
            fake_inputs = tuple(
                fake_mode.from_tensor(x) if isinstance(x, torch.Tensor) else x
                for x in example_inputs
            )
            model(*fake_inputs)
    except Exception as e:
        module = stack[-1] if stack else "<root>"
        # FakeTensorMode's data-dependent and unsupported-op exceptions carry the op
        op = getattr(e, "func", None) or "a Python-level operation"
        return f"op {op} in module {module or '<root>'} ({type(e).__name__})"
    finally:
        for h in hooks:
            h.remove()
    return None
