"""The planning verbs as a user runs them: exit codes, --json, messages, compare, plots."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from autopar.cli import main
from autopar.cli.compare import parse_config
from autopar.errors import AutoparError

REPO = Path(__file__).resolve().parents[3]
PLAN_ARGS = ["plan", "gpt-tiny", "--profile", "dgx_h100", "--nodes", "2", "--batch", "64"]


@pytest.fixture(scope="module")
def plan_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("plan")
    assert main([*PLAN_ARGS, "-o", str(out)]) == 0
    return out


def test_plan_prints_summary_and_writes_plan_json(plan_dir: Path, capsys) -> None:
    assert main([*PLAN_ARGS, "-o", str(plan_dir)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("Plan for GPT") and "mesh" in out and "step-time breakdown" in out
    assert (plan_dir / "plan.json").is_file()


def test_plan_json_is_only_json(tmp_path: Path, capsys) -> None:
    assert main([*PLAN_ARGS, "-o", str(tmp_path), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["model"] == "GPT" and data["world_size"] == 16
    assert json.loads((tmp_path / "plan.json").read_text()) == data


def test_plan_plots(tmp_path: Path, capsys) -> None:
    assert main([*PLAN_ARGS, "-o", str(tmp_path), "--plots", str(tmp_path / "p")]) == 0
    for kind in ("pipeline", "memory", "breakdown"):
        png = tmp_path / "p" / f"{kind}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_explain_of_saved_plan(plan_dir: Path, capsys) -> None:
    assert main(["explain", str(plan_dir / "plan.json")]) == 0
    out = capsys.readouterr().out
    for head in ("Bottleneck:", "Binding constraint:", "Memory:", "Sensitivity"):
        assert head in out
    assert "2x inter-node bandwidth" in out and "+50% HBM" in out


def test_compare_shows_both_configs(plan_dir: Path, capsys) -> None:
    plan = json.loads((plan_dir / "plan.json").read_text())
    assert main(["compare", str(plan_dir / "plan.json"), "--config", "tp=4,dp=4,sp=1"]) == 0
    out = capsys.readouterr().out
    assert "plan:  " + _config_text(plan["config"]) in out
    assert "yours: dp=4 fsdp=1 cp=1 tp=4 pp=1 ep=1" in out
    assert "step time" in out and "faster:" in out


def test_compare_json_and_same_config_gives_same_time(plan_dir: Path, capsys) -> None:
    plan = json.loads((plan_dir / "plan.json").read_text())
    cfg = plan["config"]
    text = ",".join(f"{k}={int(v) if isinstance(v, bool) else v}" for k, v in cfg.items())
    assert main(["compare", str(plan_dir / "plan.json"), "--config", text, "--json"]) == 0
    both = json.loads(capsys.readouterr().out)
    assert both["yours"]["config"] == cfg
    assert both["yours"]["step_time_s"] == pytest.approx(plan["step_time_s"], rel=1e-9)


def test_compare_reads_printed_configs(plan_dir: Path, capsys) -> None:
    """The config text the summary and the alternatives print is a valid --config."""
    plan = json.loads((plan_dir / "plan.json").read_text())
    text = _config_text(plan["config"])
    assert main(["compare", str(plan_dir / "plan.json"), "--config", text, "--json"]) == 0
    both = json.loads(capsys.readouterr().out)
    assert both["yours"]["config"] == plan["config"]
    assert both["yours"]["step_time_s"] == pytest.approx(plan["step_time_s"], rel=1e-9)
    printed = [alt["config"] for alt in plan["alternatives"]]
    assert printed and all(parse_config(t).as_text() == t for t in printed)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["plan", "no-such-model"], "unknown model 'no-such-model'"),
        (["plan", "gpt-tiny", "--profile", "no_such_profile"], "unknown hardware profile"),
        (["explain", "/no/such/plan.json"], "no such plan file"),
    ],
)
def test_autopar_errors_exit_1_with_message(argv: list[str], message: str, capsys) -> None:
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_compare_bad_config_exits_1(plan_dir: Path, capsys) -> None:
    assert main(["compare", str(plan_dir / "plan.json"), "--config", "tp=3"]) == 1
    assert "world size 16" in capsys.readouterr().err
    assert main(["compare", str(plan_dir / "plan.json"), "--config", "bogus=1"]) == 1
    assert "bogus=1" in capsys.readouterr().err


def test_usage_errors_exit_2() -> None:
    with pytest.raises(SystemExit) as e:
        main(["plan"])
    assert e.value.code == 2


def test_python_dash_m_exit_code_and_no_traceback() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "autopar", "plan", "no-such-model"],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
    )
    assert done.returncode == 1, done.stderr
    assert (
        done.stderr.startswith("autopar: error: unknown model") and "Traceback" not in done.stderr
    )


@pytest.mark.parametrize("verb", ["plan", "explain", "compare", "list-models", "list-profiles"])
def test_help_shows_an_example(verb: str, capsys) -> None:
    with pytest.raises(SystemExit) as e:
        main([verb, "--help"])
    assert e.value.code == 0
    assert "example: autopar " + verb in capsys.readouterr().out


def test_list_models(capsys) -> None:
    assert main(["list-models"]) == 0
    out = capsys.readouterr().out
    assert "gpt-tiny" in out and "llama3-8b" in out


def test_parse_config_aliases_and_errors() -> None:
    cfg = parse_config("tp=8,pp=4,schedule=interleaved_1f1b,v=2,sp=on,zero=1,fsdp=2,mbs=2")
    assert (cfg.tp, cfg.pp, cfg.virtual_stages, cfg.zero_stage) == (8, 4, 2, 1)
    assert cfg.sequence_parallel and cfg.micro_batch_size == 2
    with pytest.raises(AutoparError, match="integer"):
        parse_config("tp=eight")
    with pytest.raises(AutoparError, match="empty"):
        parse_config("")


def _config_text(cfg: dict) -> str:
    from autopar.config import ParallelConfig

    return ParallelConfig(**cfg).as_text()


def test_moe_imbalance_is_priced_and_stated_or_refused(tmp_path: Path, capsys) -> None:
    """A run's program prints the busiest ep rank's load; `--moe-imbalance` prices it."""
    args = ["plan", "moe-tiny", "--profile", "dgx_h100", "--nodes", "1", "--batch", "64"]
    assert main([*args, "-o", str(tmp_path), "--json"]) == 0
    even = json.loads(capsys.readouterr().out)
    assert main([*args, "-o", str(tmp_path), "--json", "--moe-imbalance", "1.5"]) == 0
    skewed = json.loads(capsys.readouterr().out)
    assert even["experts"]["imbalance"] == 1.0 and skewed["experts"]["imbalance"] == 1.5
    assert main([*args, "-o", str(tmp_path), "--moe-imbalance", "0.5"]) == 1
    err = capsys.readouterr().err
    assert "--moe-imbalance: moe_imbalance must be a finite number in [1, 1024]" in err
