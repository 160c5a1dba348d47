"""The README's code blocks run as written, from the repository root.

Every fenced ``python`` block runs in a fresh interpreter, after the import lines of the python
blocks above it (the README's examples build on each other's imports). Every fenced ``bash``
block runs with bash, line by line, stopping at the first failure (``set -e``), except the
first block: its two commands (set up, run the whole suite) are what CI itself runs. Blocks
that trace published model shapes or plan them are marked slow.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FENCE = re.compile(r"^```(\w+)\n(.*?)^```", re.MULTILINE | re.DOTALL)
# a block that traces or plans a published shape takes seconds to a minute
SLOW = re.compile(r"8b|70b|405b|1\.3b|parallelize|demo|plan |evaluate\(")


def _blocks() -> list[tuple[str, str, str]]:
    """(id, language, source) of the runnable blocks, python ones with earlier imports."""
    out: list[tuple[str, str, str]] = []
    imports: list[str] = []
    found = FENCE.findall((REPO / "README.md").read_text())
    for i, (lang, body) in enumerate(found):
        if lang == "python":
            out.append((f"python-{i}", lang, "\n".join([*imports, body])))
            imports += [line for line in body.splitlines() if re.match(r"(import|from) \S+", line)]
        elif lang == "bash" and "scripts/setup.sh" not in body:
            out.append((f"bash-{i}", lang, body))
    return out


BLOCKS = _blocks()


def _param(block: tuple[str, str, str]) -> object:
    marks = [pytest.mark.slow] if SLOW.search(block[2]) else []
    return pytest.param(block[1], block[2], id=block[0], marks=marks)


def test_readme_has_runnable_blocks() -> None:
    langs = [b[1] for b in BLOCKS]
    assert langs.count("python") >= 4 and langs.count("bash") >= 2


@pytest.mark.parametrize(("lang", "source"), [_param(b) for b in BLOCKS])
def test_readme_block_runs(lang: str, source: str) -> None:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    env["MPLBACKEND"] = "Agg"
    argv = [sys.executable, "-c", source] if lang == "python" else ["bash", "-e", "-c", source]
    done = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"stdout:\n{done.stdout[-3000:]}\nstderr:\n{done.stderr[-3000:]}"
