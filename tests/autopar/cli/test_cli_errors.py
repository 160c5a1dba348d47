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
    # issue 45: options out of range, precision the device lacks
    "negative time limit": (["plan", "gpt-tiny", "--profile", "local_cpu", "--devices", "2",
                             "--time-limit", "-5"], "time_limit_s must be a finite number"),
    "nan time limit": (["plan", "gpt-tiny", "--profile", "local_cpu", "--devices", "2",
                        "--time-limit", "nan"], "time_limit_s must be a finite number"),
    "huge moe imbalance": (["plan", "moe-tiny", "--profile", "local_cpu", "--devices", "2",
                            "--moe-imbalance", "1e9"], "moe_imbalance must be a finite number"),
    "bf16 on V100": (["plan", "gpt-tiny", "--profile", "dgx_v100", "--precision", "bf16",
                      "--batch", "8"], "it has no bf16 tensor cores"),
    "sites without a link": (["plan", "gpt-tiny", "--profile", "dgx_h100", "--nodes", "2",
                              "--sites", "2"], "2 sites need site_link_gbps > 0"),
    "sites not dividing nodes": (["plan", "gpt-tiny", "--profile", "dgx_h100", "--nodes", "3",
                                  "--sites", "2", "--site-link-gbps", "100"],
                                 "3 nodes do not split over 2 sites"),
    "negative token budget": (["plan", "gpt-tiny", "--profile", "local_cpu", "--devices", "2",
                               "--token-budget", "-5"], "token_budget must be > 0 tokens"),
}  # fmt: skip

# issue 45: a hostile config.json's shape, refused naming the field
_LLAMA = {"model_type": "llama", "vocab_size": 128, "hidden_size": 64, "intermediate_size": 128,
          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}  # fmt: skip
HOSTILE = {
    "zero heads": ({"num_attention_heads": 0}, "num_attention_heads must be a whole number"),
    "heads do not divide": ({"hidden_size": 65}, "65 is not a multiple of the 4 attention"),
    "string hidden size": ({"hidden_size": "64"}, "hidden_size must be a whole number"),
    "float layer count": ({"num_hidden_layers": 2.5}, "num_hidden_layers must be a whole"),
    "zero layers": ({"num_hidden_layers": 0}, "num_hidden_layers must be a whole number"),
    "negative layers": ({"num_hidden_layers": -2}, "num_hidden_layers must be a whole number"),
    "negative vocabulary": ({"vocab_size": -5}, "vocab_size must be a whole number"),
    "null vocabulary": ({"vocab_size": None}, "vocab_size must be a whole number"),
    "unknown activation": ({"hidden_act": "nope"}, "transformers cannot"),
    "a million layers": ({"num_hidden_layers": 10**6}, "at most 1,024 layers"),
    "a list window": ({"sliding_window": [1, 2]}, "sliding_window must be a whole number"),
    "fewer heads than kv heads": ({"num_attention_heads": 1}, "not a multiple of the 2 key-value"),
}


@pytest.mark.parametrize("label", sorted(HOSTILE))
def test_a_hostile_config_json_is_one_line(label: str, tmp_path, capsys) -> None:
    import json

    change, fragment = HOSTILE[label]
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**_LLAMA, **change}))
    argv = ["plan", str(path), "--profile", "local_cpu", "--devices", "2", "--batch", "4",
            "-o", str(tmp_path / "out")]  # fmt: skip
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert err.startswith("autopar: error: ") and fragment in err, err
    assert "Traceback" not in err and err.count("\n") == 1, err


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
