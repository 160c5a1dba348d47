"""`autopar generate`: a saved plan's program, byte for byte what plan.save writes; bad input
refused with exit 1 and nothing written."""

from __future__ import annotations

import json

import autopar
from autopar.cli import main
from autopar.models import zoo


def _saved_plan(tmp_path):
    model = zoo.build("gpt-tiny", device="meta")
    cluster = autopar.Cluster.from_profile("local_cpu", num_devices=2)
    plan = autopar.evaluate(
        model,
        cluster,
        autopar.ParallelConfig(tp=2, sequence_parallel=True),
        zoo.example_inputs("gpt-tiny", model),
        global_batch_size=4,
        precision="fp32",
    )
    plan.save(tmp_path / "a")
    return tmp_path / "a"


def test_generate_writes_the_same_program_as_save(tmp_path, capsys):
    saved = _saved_plan(tmp_path)
    assert main(["generate", str(saved / "plan.json"), "-o", str(tmp_path / "b")]) == 0
    assert "torchrun --nproc-per-node=2" in capsys.readouterr().out
    for name in ("plan.json", "train.py"):
        assert (tmp_path / "b" / name).read_bytes() == (saved / name).read_bytes()


def test_generate_refuses_bad_plans_and_writes_nothing(tmp_path, capsys):
    saved = _saved_plan(tmp_path)
    broken = tmp_path / "broken.json"
    broken.write_text((saved / "plan.json").read_text()[:100])
    no_factory = tmp_path / "nofactory.json"
    data = json.loads((saved / "plan.json").read_text())
    data["model_source"] = None
    no_factory.write_text(json.dumps(data))
    cases = [
        (tmp_path / "missing.json", "no such plan file"),
        (broken, "not valid JSON"),
        (no_factory, "records no model factory"),
    ]
    for i, (path, fragment) in enumerate(cases):
        out = tmp_path / f"out{i}"
        assert main(["generate", str(path), "-o", str(out)]) == 1
        assert fragment in capsys.readouterr().err
        assert not out.exists()
