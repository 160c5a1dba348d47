"""Importing torchao without its noise on a CPU-only torch; fake-tensor runs without torch's
log of the failure they report.

torchao (which Hugging Face transformers imports while building a model, when it is installed)
logs a warning for each CUDA extension it cannot load on a CPU build of torch, and torch logs
deprecation warnings for the enums torchao registers: none of it concerns a planning run or a
CPU test. `import_torchao` imports it once with those two loggers raised to ERROR, so later
imports find it loaded and print nothing. Warnings and errors of anything else are untouched.

`quiet_fake_tensors()`: FakeTensorMode logs an op's failure (with its traceback) before raising
it; where autopar catches that failure and reports it in one line (a trace that fails, a split
a model's code does not take), the log is the same failure said again, over many lines.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import logging
import sys
from collections.abc import Iterator

_NOISY = ("torchao", "torch.utils._pytree")


@contextlib.contextmanager
def quiet_fake_tensors() -> Iterator[None]:
    """torch's fake-tensor logger at CRITICAL for the block (module docstring)."""
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def import_torchao() -> bool:
    """Import torchao quietly if it is installed; whether it is."""
    if "torchao" in sys.modules:
        return True
    if importlib.util.find_spec("torchao") is None:
        return False
    loggers = [logging.getLogger(name) for name in _NOISY]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        import torchao  # noqa: F401

        # the modules that register the enums torch warns about (transformers imports them)
        for name in ("torchao.float8", "torchao.prototype.mx_formats"):
            with contextlib.suppress(ImportError):  # another release: nothing to quiet there
                importlib.import_module(name)
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)
    return True
