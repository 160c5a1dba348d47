"""Every user error at the command line: exit 1, one line naming the problem, no traceback.

Files that cannot be written or read (a file where the output directory should be, a path
under a read-only file system, binary bytes where a profile, a plan or a config.json should
be), values that do not parse, and output into a closed pipe; `--traceback` shows the
traceback when asked.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from autopar.cli import main

BINARY = bytes(range(128, 256)) * 4  # not UTF-8


@pytest.fixture
def files(tmp_path: Path) -> dict[str, Path]:
    out = {"file": tmp_path / "a-file", "profile": tmp_path / "bin.toml"}
    out |= {"plan": tmp_path / "bin.json", "config": tmp_path / "config.json"}
    out["file"].write_text("not a directory\n")
    out["empty"] = tmp_path / "empty"
    out["empty"].mkdir()
    for key in ("profile", "plan", "config"):
        out[key].write_bytes(BINARY)
    return out


CASES = {
    "output is a file": (["plan", "gpt-tiny", "--profile", "local_cpu", "--devices", "2",
                          "--batch", "8", "-o", "{file}"], "is a file, not a directory"),
    "output under /proc": (["plan", "gpt-tiny", "--profile", "local_cpu", "--devices", "2",
                            "--batch", "8", "-o", "/proc/autopar-out"], "/proc/autopar-out"),
    "binary profile": (["cluster", "{profile}"], "not a TOML text file"),
    "binary plan": (["explain", "{plan}"], "not a plan.json (its bytes are not UTF-8 text)"),
    "binary config.json": (["plan", "{config}", "--profile", "local_cpu"], "config.json"),
    "bad slice": (["cluster", "tpu_v5p", "--slice", "4x4xq"], "--slice wants dims like 4x4x4"),
    "negative devices": (["plan", "gpt-tiny", "--profile", "local_cpu", "--devices", "-2"],
                         "num_devices"),
    "no checkpoint to export": (["export-hf", "{empty}", "-o", "{empty}/hf"],
                                "no complete autopar checkpoint"),
    "export-hf --config missing": (["export-hf", "{empty}", "-o", "{empty}/hf", "--config",
                                    "{empty}/nope.json"], "no such file"),
    "a directory without config.json": (["plan", "{empty}", "--profile", "local_cpu"],
                                        "unknown model"),
}  # fmt: skip


@pytest.mark.parametrize("label", sorted(CASES))
def test_user_errors_exit_1_with_one_line(label: str, files, capsys) -> None:
    argv, fragment = CASES[label]
    argv = [a.format(**files) for a in argv]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert err.startswith("autopar: error: ") and fragment in err, err
    assert "Traceback" not in err and err.count("\n") == 1, err


def test_traceback_on_request(files) -> None:
    with pytest.raises(Exception, match="not a plan.json"):
        main(["--traceback", "explain", str(files["plan"])])


def test_a_closed_pipe_ends_quietly() -> None:
    """`autopar list-models | head -0`: the reader is gone before the output is written."""
    reader, writer = os.pipe()
    os.close(reader)
    done = subprocess.run(
        [sys.executable, "-m", "autopar", "list-models"],
        stdout=writer,
        stderr=subprocess.PIPE,
        text=True,
        timeout=120,
    )
    os.close(writer)
    assert done.returncode == 1
    assert done.stderr == "", done.stderr
