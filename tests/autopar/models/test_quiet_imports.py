"""Building a Hugging Face model with torchao installed prints nothing of torchao's: its
CUDA-extension warnings and torch's enum deprecations are silenced at import
(autopar.models.quiet), while a warning of autopar's own still reaches stderr."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytest.importorskip("torchao")


def test_a_hugging_face_build_leaves_stderr_clean():
    code = (
        "import logging, autopar.models.hf as h; h.build('llama-tiny-hf'); "
        "logging.getLogger('autopar').warning('still heard')"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert done.stderr.strip().splitlines() == ["still heard"], done.stderr[-2000:]
