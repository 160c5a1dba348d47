"""What a training run checks before its first step, and after every one: one-line errors.

In: the run's `TrainOptions` and `Task`, on every rank. Out: nothing, or `RunError` naming the
option and the value -- the same on every rank, so that every rank stops before a collective
waits on one that did not: a generated program prints it once, from rank 0, and exits 1
(`codegen.program`'s entry point).

Before the startup (`check_options`) and the first step (`check_batch`):
- options in range: steps >= 0, a learning rate finite and >= 0, warmup >= 0, clipping > 0,
  skips allowed >= 0;
- the paths it will write (checkpoint directory, metrics log, Hugging Face output) writable:
  a file made and removed in each;
- the data: one batch of the step-0 samples this rank reads, through the task's data (a
  user's hook included): inputs a tuple of tensors of that many samples, targets a tensor;
  integer token ids where the task's model takes token ids.
On the first loss (`check_loss`): a scalar floating tensor that autograd can differentiate
(a `--loss` returning a vector, an int or a detached value is named).
After every step (`check_finite`): a loss or gradient norm that is NaN or infinite stops the
run, naming the step and the newest checkpoint to resume from -- or, where the user allowed
some (`--skip-nonfinite N`, `skip_nonfinite`), the step is skipped: no optimizer step, its
gradients dropped, its samples not read again (as large runs skip a bad batch), said on rank 0.
The allowance counts within one process: a resumed run starts it afresh.

Public functions:
    RunError
    check_options(options)
    check_batch(task, start, stop, token_ids)
    check_loss(loss, where)
    check_finite(step, loss, grad_norm, checkpoint_dir)
    skip_nonfinite(step, loss, grad_norm, left, log)
"""

from __future__ import annotations

import math
import os
import tempfile
from pathlib import Path
from typing import Any

import torch

from autopar.errors import AutoparError


class RunError(AutoparError, ValueError):
    """A run that cannot start or go on as asked: an option, a hook, a path or a number."""


def check_options(options: Any) -> None:
    """The options and the paths the run will write (module docstring), before its startup."""
    _check_numbers(options)
    checkpoint = getattr(options, "checkpoint", None)
    for what, directory in (
        ("--checkpoint-dir", checkpoint.directory if checkpoint else None),
        ("--metrics", Path(options.metrics_path).parent if options.metrics_path else None),
        ("--save-hf", options.save_hf),
        ("--tensorboard", options.tensorboard_dir),
    ):
        if directory is not None:
            _writable(what, Path(directory))


def _check_numbers(options: Any) -> None:
    if not isinstance(options.steps, int) or options.steps < 0:
        raise RunError(f"--steps must be a whole number >= 0, got {options.steps!r}")
    if not (math.isfinite(options.lr) and options.lr >= 0):
        raise RunError(f"--lr must be a finite number >= 0, got {options.lr!r}")
    if not isinstance(options.skip_nonfinite, int) or options.skip_nonfinite < 0:
        raise RunError(f"--skip-nonfinite must be a whole number >= 0, got "
                       f"{options.skip_nonfinite!r}")  # fmt: skip
    if options.warmup_steps < 0:
        raise RunError(f"--warmup-steps must be >= 0, got {options.warmup_steps!r}")
    if not (math.isfinite(options.max_grad_norm) and options.max_grad_norm > 0):
        raise RunError(
            f"the gradient clip must be a finite number > 0, got {options.max_grad_norm}"
        )


def _writable(what: str, directory: Path) -> None:
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=f".autopar-probe-{os.getpid()}-", dir=directory)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise RunError(f"{what} {directory}: cannot write there ({e.strerror or e})") from None


def check_batch(task: Any, start: int, stop: int, token_ids: bool) -> None:
    """One batch of this rank's step-0 samples, through the task's data (module docstring);
    ``token_ids``: the model reads its first input through an embedding."""
    where = f"the data ({task.description or 'the task'})"
    try:
        got = task.batch(0, start, stop)
    except (RunError, KeyboardInterrupt):
        raise
    except Exception as e:  # noqa: BLE001 -- the user's hook: whatever it raises, one line
        raise RunError(f"{where} failed on step 0's samples [{start}, {stop}): "
                       f"{type(e).__name__}: {e}") from None  # fmt: skip
    if not (isinstance(got, tuple | list) and len(got) == 2):
        raise RunError(f"{where} must return (inputs, targets), got {type(got).__name__}")
    inputs, targets = got
    if not (isinstance(inputs, tuple | list) and inputs
            and all(isinstance(t, torch.Tensor) for t in inputs)):  # fmt: skip
        raise RunError(f"{where}: inputs must be a non-empty tuple of tensors, got "
                       f"{type(inputs).__name__}")  # fmt: skip
    if not isinstance(targets, torch.Tensor):
        raise RunError(f"{where}: targets must be a tensor, got {type(targets).__name__}")
    want = stop - start
    for name, t in [*((f"inputs[{i}]", t) for i, t in enumerate(inputs)), ("targets", targets)]:
        if t.dim() == 0 or t.shape[0] != want:
            raise RunError(f"{where}: {name} has shape {tuple(t.shape)}; its first dimension "
                           f"must be the {want} samples [{start}, {stop})")  # fmt: skip
    if token_ids and (inputs[0].is_floating_point() or inputs[0].is_complex()):
        raise RunError(f"{where}: inputs[0] holds {inputs[0].dtype} values; the model reads "
                       "token ids, an integer tensor")  # fmt: skip


def check_loss(loss: Any, where: str) -> None:
    """``loss`` is what backward can start from: a scalar floating tensor with a gradient."""
    if not isinstance(loss, torch.Tensor):
        raise RunError(f"{where} returned {type(loss).__name__}, not a tensor")
    if loss.numel() != 1:
        raise RunError(f"{where} returned a tensor of shape {tuple(loss.shape)}: one number "
                       "(the batch's mean loss) is needed")  # fmt: skip
    if not loss.is_floating_point():
        raise RunError(f"{where} returned a {loss.dtype} tensor: a floating loss is needed")
    if not loss.requires_grad:
        raise RunError(f"{where} returned a value without gradient (computed under no_grad, "
                       "detached, or not from the model's outputs)")  # fmt: skip


def skip_nonfinite(step: int, loss: float, grad_norm: float, left: int, log: bool) -> bool:
    """True where the step's numbers are not finite and ``left`` more skips are allowed."""
    if left <= 0 or (math.isfinite(loss) and math.isfinite(grad_norm)):
        return False
    if log:
        said = f"the loss is {loss} and the gradient norm {grad_norm}"
        print(f"[autopar] step {step} skipped: {said}; no optimizer step ({left - 1} more "
              "skips allowed)", flush=True)  # fmt: skip
    return True


def check_finite(step: int, loss: float, grad_norm: float, checkpoint_dir: str | None) -> None:
    """Stop at a non-finite loss or gradient norm, naming the step and where to resume."""
    if math.isfinite(loss) and math.isfinite(grad_norm):
        return
    resume = "no checkpoint to resume from (no --checkpoint-dir)"
    if checkpoint_dir:
        from autopar.runtime.checkpoint import latest_checkpoint

        newest = latest_checkpoint(checkpoint_dir)
        resume = f"the last good checkpoint is {newest}" if newest else (
            f"no checkpoint in {checkpoint_dir} yet")  # fmt: skip
    raise RunError(f"step {step}: the loss is {loss} and the gradient norm {grad_norm}; "
                   f"stopped before the optimizer step ({resume})")  # fmt: skip
