"""The same inputs give a byte-identical plan.json, also across separate processes.

Each process traces and plans from scratch (fresh caches, its own hash seed), so any
dependence on dict/set iteration order, object ids or wall-clock time shows up as a diff.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys

import pytest

_PLAN = """
import sys
import autopar
from autopar.models import zoo
model = zoo.build("llama-tiny", device="meta", num_layers=4)
cluster = autopar.Cluster.from_profile("dgx_h100")
plan = autopar.parallelize(model, cluster, global_batch_size=64)
plan.save(sys.argv[1])
"""


@pytest.mark.slow
def test_two_processes_write_the_same_plan_bytes(tmp_path):
    digests = []
    for i, seed in enumerate(("1", "2")):
        out = tmp_path / f"run{i}"
        env = {**os.environ, "PYTHONHASHSEED": seed}
        subprocess.run([sys.executable, "-c", _PLAN, str(out)], check=True, env=env, timeout=300)
        digests.append(hashlib.sha256((out / "plan.json").read_bytes()).hexdigest())
    assert digests[0] == digests[1]
