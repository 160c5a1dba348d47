"""A plan file is data whatever it holds (issue 45): strings with quotes, newlines and shell
metacharacters and numbers of any size in its fields, through every verb that writes from it.

Each example edits a real saved plan.json (gpt-tiny on 2 local_cpu ranks) and runs `generate`,
`export --to torchtitan|megatron|deepspeed|accelerate`, `explain`, `compare` or `replan` on
it, in process. Either the verb refuses in one line (exit 1, no traceback), or what it wrote
parses with its own parser -- train.py with `ast`, megatron_args.sh with `bash -n`, the TOML
with `tomllib`, the YAML with `yaml`, the launchers likewise -- and nothing the strings say ran
(no marker file). A config.json is fuzzed the same way through `autopar plan`: its fields set
to numbers of any size, strings, nulls, lists and objects. Bounded: a few dozen examples,
seconds each.
"""

from __future__ import annotations

import ast
import json
import subprocess
from pathlib import Path

import pytest
import tomllib
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import autopar
from autopar.cli import main

MARKER = "/tmp/autopar-fuzz-marker"
PAYLOADS = [
    f'"; touch {MARKER}; "',
    f"$(touch {MARKER})",
    f"`touch {MARKER}`",
    f'""" + __import__("os").system("touch {MARKER}") + """',
    f"\ntouch {MARKER}\n",
    "'\n[job]\nx = 1\n#",
    "\\",
    "\x00",
]
TEXT = st.one_of(st.sampled_from(PAYLOADS), st.text(max_size=40))
NUMBER = st.one_of(st.integers(-(2**40), 2**40), st.floats(allow_nan=True, allow_infinity=True))
FIELDS = ["model", "stack", "cluster", "cluster_fingerprint", "optimizer", "precision"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("fuzzplan")
    model = autopar.models.zoo.build("gpt-tiny", device="meta")
    cluster = autopar.Cluster.from_profile("local_cpu", num_devices=2)
    config = autopar.ParallelConfig(dp=2, micro_batch_size=2)
    inputs = autopar.models.zoo.example_inputs("gpt-tiny", model)
    autopar.evaluate(model, cluster, config, inputs, global_batch_size=8).save(out, program=False)
    return json.loads((out / "plan.json").read_text())


def _check_outputs(out: Path) -> None:
    for path in out.iterdir():
        text = path.read_text()
        if path.suffix == ".py":
            ast.parse(text)
        elif path.suffix in (".sh", ".sbatch"):
            done = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
            assert done.returncode == 0, (path.name, done.stderr)
        elif path.suffix == ".toml":
            tomllib.loads(text)
        elif path.suffix in (".yaml", ".yml"):
            list(yaml.safe_load_all(text))
        elif path.suffix == ".json":
            json.loads(text)


def _leaves(value, path=()) -> list[tuple]:
    """The path of every string, number, bool and null in a JSON value."""
    if isinstance(value, dict):
        return [p for k, v in value.items() for p in _leaves(v, (*path, k))]
    if isinstance(value, list):
        return [p for i, v in enumerate(value) for p in _leaves(v, (*path, i))]
    return [path]


def _set(plan: dict, path: tuple, value) -> None:
    """Put ``value`` at ``path`` (keys and indices) inside ``plan``."""
    for key in path[:-1]:
        plan = plan[key]
    plan[path[-1]] = value


VALUE = st.one_of(TEXT, NUMBER, st.none(), st.booleans(), st.lists(TEXT, max_size=2),
                  st.dictionaries(TEXT, TEXT, max_size=2))  # fmt: skip


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(field=st.sampled_from(FIELDS + ["stages[0].layers[0]", "seq_len", "step_time_s"]),
       text=TEXT, number=NUMBER, data=st.data())  # fmt: skip
def test_no_field_of_a_plan_file_runs_or_breaks_what_is_written(
    saved, tmp_path_factory, capsys, field, text, number, data
):
    """Half the examples edit a field known to reach a written file; the others any leaf of
    plan.json (its 360-odd strings and numbers), to a value of any JSON type."""
    marker = Path(MARKER)
    marker.unlink(missing_ok=True)
    plan = json.loads(json.dumps(saved))
    if data.draw(st.booleans()):
        field = data.draw(VALUE)
        _set(plan, data.draw(st.sampled_from(_leaves(plan))), field)
    elif field == "stages[0].layers[0]":
        plan["stages"][0]["layers"][0] = text
    elif field in ("seq_len", "step_time_s"):
        plan[field] = number
    else:
        plan[field] = text
    root = tmp_path_factory.mktemp("fuzz")
    (root / "plan.json").write_text(json.dumps(plan))
    verb = data.draw(st.sampled_from(["generate", "torchtitan", "megatron", "deepspeed",
                                      "accelerate", "explain", "compare", "replan"]))  # fmt: skip
    out = root / "out"
    if verb in ("generate", "explain"):
        argv = [verb, str(root / "plan.json"), *(["-o", str(out)] if verb == "generate" else [])]
    elif verb == "compare":
        argv = ["compare", str(root / "plan.json"), "--config", "dp=2"]
    elif verb == "replan":
        argv = ["replan", str(root / "plan.json"), "--devices", "2", "--config", "dp=2",
                "-o", str(out)]  # fmt: skip
    else:
        argv = ["export", str(root / "plan.json"), "--to", verb, "-o", str(out), "--no-price"]
    code = main(argv)
    said = capsys.readouterr()
    assert code in (0, 1), (argv, said.err)
    if code == 1:
        assert said.err.startswith("autopar: error: ") and said.err.count("\n") == 1, said.err
        assert "Traceback" not in said.err
    elif out.is_dir():
        _check_outputs(out)
    assert not marker.exists(), (field, text)


LLAMA = {"model_type": "llama", "vocab_size": 128, "hidden_size": 64, "intermediate_size": 128,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}  # fmt: skip
CONFIG_FIELDS = [*LLAMA, "head_dim", "max_position_embeddings", "rope_theta", "rms_norm_eps",
                 "torch_dtype", "tie_word_embeddings", "hidden_act", "rope_scaling",
                 "sliding_window", "eos_token_id", "num_local_experts", "auto_map"]  # fmt: skip
ANY = st.one_of(
    st.integers(-3, 3),
    st.sampled_from([2**31, 2**40, 2**63, 10**6]),
    st.floats(allow_nan=True, allow_infinity=True),
    TEXT,
    st.none(),
    st.booleans(),
    st.lists(st.integers(-2, 2), max_size=3),
    st.dictionaries(st.sampled_from(["type", "rope_type", "factor"]), TEXT, max_size=2),
)


@settings(
    max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(changes=st.dictionaries(st.sampled_from(CONFIG_FIELDS), ANY, min_size=1, max_size=2))
def test_no_field_of_a_config_json_breaks_the_planner(tmp_path_factory, capsys, changes):
    marker = Path(MARKER)
    marker.unlink(missing_ok=True)
    root = tmp_path_factory.mktemp("fuzzconfig")
    try:
        (root / "config.json").write_text(json.dumps({**LLAMA, **changes}))
    except ValueError:  # a value JSON cannot hold (a NUL is fine; this is a float overflow)
        return
    argv = ["plan", str(root / "config.json"), "--profile", "local_cpu", "--devices", "2",
            "--batch", "4", "--seq-len", "32", "--time-limit", "5",
            "-o", str(root / "out")]  # fmt: skip
    code = main(argv)
    said = capsys.readouterr()
    assert code in (0, 1), (changes, said.err)
    if code == 1:  # transformers may warn first ("[transformers] Model config: ..."), one line
        lines = said.err.splitlines()
        assert lines[-1].startswith("autopar: error: ") and "Traceback" not in said.err, said.err
        assert all(line.startswith("[transformers]") for line in lines[:-1]), said.err
    else:
        json.loads((root / "out" / "plan.json").read_text())
    assert not marker.exists(), changes


@pytest.mark.parametrize(
    "path, value, fragment",
    [
        (("mesh", 0, "num_nodes"), "x", "mesh[0].num_nodes must be an integer >= 0"),
        (("mesh", 0, "ranks"), [0, "1"], "mesh[0].ranks must be a list of ranks"),
        (("communication", 0, 0, "bytes"), None, "communication[0][0].bytes must be a number"),
        (("notes",), [3], "notes[0] must be a string"),
    ],
)
def test_a_record_of_another_type_is_refused_naming_it(saved, tmp_path, capsys, path, value,
                                                        fragment):  # fmt: skip
    """What the generic leaf fuzz found (each once a traceback in a printout): the records in a
    plan's lists are typed as the printouts read them."""
    plan = json.loads(json.dumps(saved))
    _set(plan, path, value)
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    assert main(["explain", str(tmp_path / "plan.json")]) == 1
    err = capsys.readouterr().err
    assert fragment in err and err.count("\n") == 1, err


def test_a_plan_made_on_a_tpu_slice_loads(tmp_path):
    """A TPU plan names its profile but not its slice's shape: it loads and explains (it was
    refused at load, the cluster rebuilt without a slice shape)."""
    model = autopar.models.zoo.build("llama-tiny", device="meta")
    cluster = autopar.Cluster.from_profile("tpu_v4", slice_shape=(2, 2, 4))
    inputs = autopar.models.zoo.example_inputs("llama-tiny", model)
    config = autopar.ParallelConfig(dp=8, tp=2)
    autopar.evaluate(model, cluster, config, inputs, global_batch_size=64).save(
        tmp_path, program=False
    )
    loaded = autopar.Plan.from_json((tmp_path / "plan.json").read_text())
    assert loaded.config.tp == 2 and "tp=2" in loaded.explain()


@pytest.mark.parametrize(
    "config",
    [
        autopar.ParallelConfig(
            dp=2,
            pp=2,
            schedule="interleaved_1f1b",
            virtual_stages=3,
            pipeline_slots=("embedding", "loss"),
        ),
        autopar.ParallelConfig(dp=2, tp=2, sequence_parallel=True, async_tp=True),
        autopar.ParallelConfig(dp=2, cp=2, cp_attention="ring"),
        autopar.ParallelConfig(dp=4, recompute="selective", recompute_modules=("mlp",)),
    ],
    ids=["slots", "async_tp", "ring", "modules"],
)
def test_a_plan_with_each_later_field_loads_back_equal(config):
    """The fields added after the first plans (lists, strings, flags) pass the loader's type
    check: a plan with async TP was refused at load ("config.async_tp must be int")."""
    model = autopar.models.zoo.build("llama-tiny", device="meta", num_layers=4)
    inputs = autopar.models.zoo.example_inputs("llama-tiny", model, batch_size=1)
    cluster = autopar.Cluster.from_profile("dgx_h100", num_devices=4)
    plan = autopar.evaluate(
        model, cluster, config, inputs, global_batch_size=8, stack="megatron-core"
    )
    assert autopar.Plan.from_json(plan.to_json()).config == config
