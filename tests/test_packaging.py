"""Packaging: the wheel ships the profiles, the cost model is torch-free, CI runs the README."""

from __future__ import annotations

import re
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```(?:bash|sh|console)?\n(.*?)```", text, flags=re.S)
    return [line for line in blocks[0].splitlines() if line and not line.startswith("#")]


def test_readme_opens_with_the_two_commands_and_ci_runs_the_test_one():
    main_job, test_suite = _readme_commands()[:2]
    assert "scripts/setup.sh" in main_job and "autopar" in main_job
    assert "scripts/setup.sh" in test_suite and "pytest" in test_suite
    ci = (ROOT / ".ci" / "run").read_text()
    assert test_suite in ci.splitlines(), "the CI script must run the README's test command"


def test_cost_models_and_profiles_do_not_import_torch():
    code = (
        "import sys, autopar, cost_models.comm, cost_models.compute, cost_models.memory, "
        "cost_models.pipeline\n"
        "autopar.Cluster.from_profile('dgx_h100', num_nodes=2).collective_time("
        "'all_reduce', 1e9, range(16))\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


@pytest.mark.slow
def test_wheel_installs_into_a_fresh_environment_and_finds_its_profiles(tmp_path):
    dist = tmp_path / "dist"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(dist), str(ROOT)],
        check=True,
    )
    (wheel,) = dist.glob("autopar-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        shipped = set(zf.namelist())
    sources = {
        str(p.relative_to(ROOT))
        for pkg in ("autopar", "cost_models", "hardware_profiles")
        for p in (ROOT / pkg).rglob("*")
        if p.suffix in (".py", ".toml") and "__pycache__" not in p.parts
    }
    assert sources <= shipped, f"missing from the wheel: {sorted(sources - shipped)}"
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    python = env_dir / "bin" / "python"
    # --no-deps: the check is that the wheel itself carries the profiles; torch and friends are
    # not needed to load one.
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", str(wheel)], check=True)
    code = (
        "import autopar, pathlib\n"
        "c = autopar.Cluster.from_profile('dgx_h100', num_nodes=2)\n"
        "print(autopar.__file__); print(c.profile.path); print(c.world_size)\n"
        "print(len(autopar.shipped_profile_names()))\n"
    )
    out = subprocess.run(
        [str(python), "-c", code], check=True, cwd=tmp_path, capture_output=True, text=True
    ).stdout.split("\n")
    package_file, profile_path, world, count = out[:4]
    assert str(env_dir) in package_file, "autopar was not imported from the fresh environment"
    assert str(env_dir) in profile_path and profile_path.endswith("dgx_h100.toml")
    assert world == "16"
    assert int(count) >= 14
