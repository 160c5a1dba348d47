"""Plan files are data: checked on load, written as a pair, never a way to run code.

- A plan.json edited by hand or damaged is refused at load with its field named (the plan's
  types, ranges and invariants, and the config against the cluster it names).
- Two processes saving plans into one directory leave one plan's plan.json and train.py, and
  a train.py refuses a plan.json other than the one it was generated from.
- A plan.json that names a factory of its own does not get it imported or called without
  the user's consent (`trust_factory` / `--trust-factory`); autopar's own factories need none.
  Nor a loss it names, nor a directory it would put on the program's import path.
- A plan's strings never become code: every string is one printable line (a newline would
  end a comment or a shell line), the stack is a name, and the program's docstring escapes
  quotes and backslashes (issue 45's four marker cases).
"""

from __future__ import annotations

import ast
import hashlib
import json
import math
import multiprocessing
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

import autopar
from autopar.cli import main
from autopar.models.source import UntrustedFactoryError
from autopar.plan import Plan, PlanError


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real gpt-tiny plan (dp=2, micro-batch 2: 2 micro-batches) on 2 local_cpu ranks,
    saved with its program."""
    out = tmp_path_factory.mktemp("plan")
    model = autopar.models.zoo.build("gpt-tiny", device="meta")
    cluster = autopar.Cluster.from_profile("local_cpu", num_devices=2)
    config = autopar.ParallelConfig(dp=2, micro_batch_size=2)
    inputs = autopar.models.zoo.example_inputs("gpt-tiny", model)
    autopar.evaluate(model, cluster, config, inputs, global_batch_size=8).save(out)
    return out


def _edited(saved: Path, tmp_path: Path, edit) -> Path:
    data = json.loads((saved / "plan.json").read_text())
    edit(data)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    return path


CASES = [
    ("tp=3 on 2 ranks", lambda d: d["config"].update(tp=3), "runs on 6 devices"),
    ("negative step time", lambda d: d.update(step_time_s=-1.0), "step_time_s must be > 0"),
    ("string world size", lambda d: d.update(world_size="2"), "world_size must be an integer"),
    ("empty stages", lambda d: d.update(stages=[]), "stages must be a non-empty list"),
    ("infinite mfu", lambda d: d.update(mfu=math.inf), "mfu must be finite"),
    ("boolean degree", lambda d: d["config"].update(tp=True), "config.tp must be int"),
    ("fsdp without ZeRO", lambda d: d["config"].update(dp=1, fsdp=2), "shards nothing"),
    ("layerless stage", lambda d: d["stages"][0].update(layers=[]), "stages[0].layers"),
    ("batch mismatch", lambda d: d.update(num_microbatches=3), "global_batch_size=8 is not"),
    ("stage count", lambda d: d["config"].update(pp=2, dp=1), "pp=2 needs one per pipeline"),
    ("peak not a stage's", lambda d: d.update(peak_memory_bytes=1.0), "not the fullest stage"),
    ("unknown precision", lambda d: d.update(precision="fp4"), "precision must be one of"),
    ("negative term", lambda d: d["breakdown"].update(optimizer=-1), "breakdown.optimizer"),
    ("factory not a path", lambda d: d["model_source"].update(factory="os.system"), "factory"),
    (
        "fractional checkpoint interval",
        lambda d: d["goodput"].update(sync_interval_steps=0.4),
        "a whole number of steps >= 1",
    ),
]


@pytest.mark.parametrize(("label", "edit", "fragment"), CASES, ids=[c[0] for c in CASES])
def test_an_unsound_plan_is_refused_at_load(saved, tmp_path, label, edit, fragment, capsys):
    path = _edited(saved, tmp_path, edit)
    with pytest.raises(PlanError, match="the plan is not sound") as err:
        Plan.from_json(path.read_text())
    assert fragment in str(err.value), label
    for argv in (["explain", str(path)], ["generate", str(path), "-o", str(tmp_path / "g")]):
        assert main(argv) == 1
        said = capsys.readouterr().err
        assert fragment in said and str(path) in said and "Traceback" not in said
    assert not (tmp_path / "g").exists()


def test_the_cluster_a_plan_names_must_exist(saved):
    """16 devices on one node of a profile whose node has 8: refused, naming the profile."""
    data = json.loads((saved / "plan.json").read_text())
    data.update(cluster="dgx_h100", world_size=16, global_batch_size=64)
    data["config"]["dp"] = 16
    with pytest.raises(PlanError, match="cluster dgx_h100 x 1 nodes of 16: .* between 1 and 8"):
        Plan.from_json(json.dumps(data))


def test_a_plan_with_infinite_numbers_is_not_written(saved, tmp_path):
    plan = Plan.from_json((saved / "plan.json").read_text())
    bad = replace(plan, breakdown={**plan.breakdown, "dp_comm": math.inf})
    with pytest.raises(PlanError, match=r"plan\.breakdown\.dp_comm = inf"):
        bad.save(tmp_path / "out")
    assert not (tmp_path / "out" / "plan.json").exists()


# ---------------------------------------------------------------- pairs written together


def _save_rounds(root: str, batch: int, rounds: int, start) -> None:
    model = autopar.models.zoo.build("gpt-tiny", device="meta")
    cluster = autopar.Cluster.from_profile("local_cpu", num_devices=2)
    plan = autopar.parallelize(model, cluster, global_batch_size=batch, precision="fp32")
    for r in range(rounds):
        start.wait()  # both processes save into this round's directory at once
        plan.save(Path(root, f"round{r}"))


@pytest.mark.slow
def test_two_processes_saving_into_one_directory_leave_one_plans_pair(tmp_path):
    """Each round, two processes save their (different) plans into one directory at once;
    every directory must end with one plan's pair. (Saving as autopar 0.1 did -- plan.json,
    then generating and writing train.py, no lock -- left a torn round in each of two runs.)"""
    rounds = 12
    spawn = multiprocessing.get_context("spawn")
    start = spawn.Barrier(2)
    jobs = [
        spawn.Process(target=_save_rounds, args=(str(tmp_path), b, rounds, start)) for b in (8, 16)
    ]
    for job in jobs:
        job.start()
    for job in jobs:
        job.join(timeout=600)
        assert job.exitcode == 0
    for r in range(rounds):
        out = tmp_path / f"round{r}"
        text = (out / "plan.json").read_text()
        Plan.from_json(text)  # whole and sound
        program = (out / "train.py").read_text()
        digest = re.search(r'PLAN_SHA256 = "([0-9a-f]{64})"', program).group(1)
        assert digest == hashlib.sha256(text.encode()).hexdigest(), f"round {r} is torn"
        assert not list(out.glob(".*.tmp"))  # no temporary file left behind


def test_a_program_refuses_a_plan_json_it_was_not_generated_from(saved, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "train.py").write_text((saved / "train.py").read_text())
    data = json.loads((saved / "plan.json").read_text())
    data["notes"] = [*data["notes"], "edited by hand"]
    (out / "plan.json").write_text(json.dumps(data, indent=1, sort_keys=True))
    done = subprocess.run(
        [sys.executable, str(out / "train.py"), "--steps", "1"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode != 0
    assert "is not the plan this train.py was generated from" in done.stderr
    assert "autopar generate" in done.stderr


# ---------------------------------------------------------------- no code from a plan file


def _crafted(saved: Path, tmp_path: Path) -> tuple[Path, Path]:
    """A plan.json whose factory would create a file: proof that it was called."""
    proof = tmp_path / "pwned"
    factory = {"factory": "subprocess:call", "kwargs": {"args": ["touch", str(proof)]}}
    path = _edited(saved, tmp_path, lambda d: d["model_source"].update(factory))
    return path, proof


@pytest.mark.parametrize(
    "argv",
    [
        ["generate", "{plan}", "-o", "{tmp}/out"],
        ["replan", "{plan}", "--num-devices", "4", "-o", "{tmp}/out"],
        ["compare", "{plan}", "--config", "dp=2"],
    ],
    ids=["generate", "replan", "compare"],
)
def test_a_plan_files_factory_runs_only_with_consent(saved, tmp_path, argv, capsys):
    path, proof = _crafted(saved, tmp_path)
    argv = [a.format(plan=path, tmp=tmp_path) for a in argv]
    assert main(argv) == 1
    said = capsys.readouterr().err
    assert "'subprocess:call', which is not one of autopar's own" in said
    assert "--trust-factory" in said and "Traceback" not in said
    assert not proof.exists() and not (tmp_path / "out").exists()
    main([*argv, "--trust-factory"])  # consent given: the factory is called (and fails)
    assert proof.exists()


def test_the_python_api_asks_for_consent_too(saved, tmp_path):
    path, proof = _crafted(saved, tmp_path)
    plan = Plan.from_json(path.read_text())
    with pytest.raises(UntrustedFactoryError):
        plan.save(tmp_path / "out")
    with pytest.raises(UntrustedFactoryError):
        autopar.replan(plan, num_devices=4)
    assert not proof.exists() and not (tmp_path / "out").exists()


def test_autopars_own_factories_and_the_users_own_plans_need_no_consent(saved, tmp_path):
    plan = Plan.from_json((saved / "plan.json").read_text())  # the zoo's factory
    assert plan.model_source.factory == "autopar.models.zoo:build"
    plan.save(tmp_path / "zoo")
    assert (tmp_path / "zoo" / "train.py").is_file()
    model = autopar.models.zoo.build("gpt-tiny", device="meta")
    cluster = autopar.Cluster.from_profile("local_cpu", num_devices=2)
    mine = autopar.evaluate(  # a factory the user hands over in this process is trusted
        model,
        cluster,
        autopar.ParallelConfig(dp=2),
        global_batch_size=8,
        graph=autopar.trace(model, autopar.models.zoo.example_inputs("gpt-tiny", model)),
        model_factory=("test_plan_files:tiny_factory", {}),
    )
    mine.save(tmp_path / "mine")
    assert "FACTORY = 'test_plan_files:tiny_factory'" in (tmp_path / "mine/train.py").read_text()
    again = Plan.from_json((tmp_path / "mine" / "plan.json").read_text())  # from the file
    with pytest.raises(UntrustedFactoryError):
        again.save(tmp_path / "again")
    again.save(tmp_path / "again", trust_factory=True)


def tiny_factory(device: str = "cpu"):
    return autopar.models.zoo.build("gpt-tiny", device=device)


# ------------------------------------------- no code from a plan's strings (issue 45, 1-4)


def _marker_plan(saved: Path, tmp_path: Path, edit) -> tuple[Path, Path]:
    path = _edited(saved, tmp_path, edit)
    return path, tmp_path / "MARKER"


def _program_help(program: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(program), "--help"], capture_output=True,
                          text=True, timeout=300)  # fmt: skip


def test_a_stack_holding_python_is_refused_and_never_runs(saved, tmp_path, capsys):
    marker = tmp_path / "MARKER"
    stack = f'autopar" + str(__import__("os").system("touch {marker}")) + "'
    path, _ = _marker_plan(saved, tmp_path, lambda d: d.update(stack=stack))
    assert main(["generate", str(path), "-o", str(tmp_path / "out")]) == 1
    said = capsys.readouterr().err
    assert "stack must be a stack's name" in said and said.count("\n") == 1
    assert not marker.exists()


def test_quotes_and_backslashes_in_a_name_stay_in_the_docstring(saved, tmp_path):
    """A model name may hold any printable text: the program's docstring escapes it, so the
    program parses, says it, and runs nothing of it."""
    marker = tmp_path / "MARKER"
    name = f'GPT """\nimport os; os.system("touch {marker}")\n""" \\'.replace("\n", " ")
    path, _ = _marker_plan(saved, tmp_path, lambda d: d.update(model=name))
    assert main(["generate", str(path), "-o", str(tmp_path / "out")]) == 0
    program = tmp_path / "out" / "train.py"
    tree = ast.parse(program.read_text())
    assert name in ast.get_docstring(tree, clean=False)
    done = _program_help(program)
    assert done.returncode == 0, done.stderr[-2000:]
    assert not marker.exists()


@pytest.mark.parametrize("field", ["model", "cluster_fingerprint"])
def test_a_newline_in_any_string_is_refused_at_load(saved, tmp_path, field, capsys):
    marker = tmp_path / "MARKER"
    value = f"gpt\ntouch {marker}"
    path, _ = _marker_plan(saved, tmp_path, lambda d: d.update({field: value}))
    for argv in (["export", str(path), "--to", "megatron", "-o", str(tmp_path / "x")],
                 ["generate", str(path), "-o", str(tmp_path / "y")]):  # fmt: skip
        assert main(argv) == 1
        said = capsys.readouterr().err
        assert f"plan.{field} holds the control character '\\n'" in said, said
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


def test_an_import_root_or_a_loss_a_plan_file_names_needs_consent(saved, tmp_path, capsys):
    marker = tmp_path / "MARKER"
    evil = tmp_path / "evil"
    (evil / "transformers").mkdir(parents=True)
    payload = f"open({str(marker)!r}, 'w').close()\n"
    (evil / "transformers" / "__init__.py").write_text(payload)
    (evil / "evilloss.py").write_text(payload + "def loss(out, target):\n    return out.sum()\n")
    edits = {
        "import_root": lambda d: d["model_source"].update(import_root=str(evil)),
        "loss": lambda d: d["model_source"].update(import_root=str(evil), loss="evilloss:loss"),
    }
    for what, edit in edits.items():
        path, _ = _marker_plan(saved, tmp_path, edit)
        out = tmp_path / f"out-{what}"
        assert main(["generate", str(path), "-o", str(out)]) == 1
        said = capsys.readouterr().err
        assert "--trust-factory" in said and "Traceback" not in said, said
        assert ("evilloss:loss" if what == "loss" else str(evil)) in said
        assert not out.exists() and not marker.exists()
    # with consent the plan is the user's: its program puts the root on the path as asked
    assert main(["generate", str(path), "-o", str(tmp_path / "ok"), "--trust-factory"]) == 0
    assert (tmp_path / "ok" / "train.py").is_file()
