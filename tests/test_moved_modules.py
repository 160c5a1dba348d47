"""Import paths of autopar 0.1 that users may hold still work, and warn with the new path.

Each runs in a fresh interpreter, so that the import really goes through the moved-module
finder (`_MOVED` in autopar/__init__.py) and its warning is not swallowed by a cache.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

# old statement -> (the object it must give, the new path the warning must name)
CASES = {
    "from autopar.cluster import Cluster": (
        "autopar.hardware.cluster.Cluster",
        "autopar.hardware.cluster",
    ),
    "from autopar.plan_text import summary_text": (
        "autopar.plan.text.summary_text",
        "autopar.plan.text",
    ),
    "from autopar.plots import plot_plan": ("autopar.plan.plots.plot_plan", "autopar.plan.plots"),
    "from autopar.layout import mesh_axes": (
        "autopar.estimate.layout.mesh_axes",
        "autopar.estimate.layout",
    ),
    "from autopar.whatif import sensitivity": (
        "autopar.solve.whatif.sensitivity",
        "autopar.solve.whatif",
    ),
    "from autopar.elastic import ReplanError": (
        "autopar.plan.rebuild.ReplanError",
        "autopar.plan.rebuild",
    ),
    "from autopar.elastic import replan": ("autopar.api.replan", "autopar.api"),
    "from autopar.commands.config_text import parse_config": (
        "autopar.config.text.parse_config",
        "autopar.config.text",
    ),
    "from autopar.commands.models import build_hf_config": (
        "autopar.models.hf.build_from_config",
        "autopar.cli.models",
    ),
    "from autopar.api import attention_heads": (
        "autopar.solve.limits.attention_heads",
        "autopar.solve.limits",
    ),
}


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-W", "always::DeprecationWarning", "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize("statement", sorted(CASES))
def test_old_import_gives_the_moved_object_and_names_its_new_path(statement: str) -> None:
    target, new_path = CASES[statement]
    module, _, name = target.rpartition(".")
    old_name = statement.split(" import ")[1]
    code = (
        f"{statement}\n"
        f"import importlib\n"
        f"assert {old_name} is getattr(importlib.import_module({module!r}), {name!r})\n"
    )
    done = _run(code)
    assert done.returncode == 0, done.stderr
    assert "DeprecationWarning" in done.stderr and new_path in done.stderr, done.stderr


def test_current_paths_import_without_warnings() -> None:
    code = (
        "import warnings; warnings.simplefilter('error')\n"
        "from autopar import Cluster, ParallelConfig, Plan, evaluate, parallelize, replan\n"
        "from autopar.plan import Plan, ModelSource, StagePlan\n"
        "from autopar.config import ParallelConfig, parse_config\n"
        "from autopar.hardware import Cluster, load_profile\n"
        "from autopar.cli import main\n"
    )
    done = _run(code)
    assert done.returncode == 0, done.stderr


def test_a_name_that_never_existed_says_where_the_module_went() -> None:
    done = _run("from autopar.cluster import NoSuchThing")
    assert done.returncode != 0
    assert "autopar.cluster moved to autopar.hardware.cluster" in done.stderr
    assert "NoSuchThing" in done.stderr


def test_import_autopar_does_not_import_torch() -> None:
    code = (
        "import sys, autopar\n"
        "from autopar.plan import Plan\n"
        "autopar.Cluster.from_profile('dgx_h100', 2)\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    done = _run(code)
    assert done.returncode == 0, done.stderr
