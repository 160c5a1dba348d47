"""Launchers plan.save writes beside train.py (autopar.codegen.launchers): the Slurm script is
valid bash whose directives and torchrun line carry the plan's nodes and devices per node, and
which, with Slurm's two commands standing in on one machine, launches train.py through a c10d
rendezvous that trains; the Kubernetes PyTorchJob parses and its replicas and processes per
replica are the plan's."""

from __future__ import annotations

import os
import re
import stat
import subprocess
from pathlib import Path

import pytest
import yaml

import autopar
from autopar.models import zoo
from autopar.plan import Plan

REPO = Path(__file__).resolve().parents[3]


def _plan(profile: str, nodes: int, config: autopar.ParallelConfig, batch: int) -> Plan:
    model = zoo.build("gpt-tiny", device="meta")
    devices = None if nodes > 1 else config.world_size
    cluster = autopar.Cluster.from_profile(profile, nodes, num_devices=devices)
    inputs = zoo.example_inputs("gpt-tiny", model)
    return autopar.evaluate(
        model, cluster, config, inputs, global_batch_size=batch, precision="fp32"
    )


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory) -> tuple[Plan, Path]:
    plan = _plan("dgx_h100", 2, autopar.ParallelConfig(fsdp=8, tp=2, zero_stage=3), 16)
    out = tmp_path_factory.mktemp("two-nodes")
    plan.save(out)
    return plan, out


def test_slurm_script_is_bash_with_the_plans_nodes_and_devices(two_nodes):
    plan, out = two_nodes
    script = out / "launch.sbatch"
    subprocess.run(["bash", "-n", str(script)], check=True)
    text = script.read_text()
    directives = dict(re.findall(r"^#SBATCH --([\w-]+)(?:=(\S+))?", text, re.MULTILINE))
    assert directives["nodes"] == str(plan.num_nodes) == "2"
    assert directives["ntasks-per-node"] == "1"  # one torchrun per node
    assert directives["gpus-per-node"] == str(plan.world_size // plan.num_nodes)
    assert "--nproc-per-node 8" in text and '--rdzv-endpoint "$head_node:29500"' in text
    assert "--checkpoint-every auto" in text


def test_kubernetes_job_has_the_plans_replicas_and_processes(two_nodes):
    plan, out = two_nodes
    job = yaml.safe_load((out / "pytorchjob.yaml").read_text())
    assert (job["apiVersion"], job["kind"]) == ("kubeflow.org/v1", "PyTorchJob")
    spec = job["spec"]
    replicas = spec["pytorchReplicaSpecs"]
    assert sum(r["replicas"] for r in replicas.values()) == plan.num_nodes
    per_node = plan.world_size // plan.num_nodes
    assert int(spec["nprocPerNode"]) == per_node
    assert spec["elasticPolicy"]["minReplicas"] == spec["elasticPolicy"]["maxReplicas"] == 2
    for replica in replicas.values():
        container = replica["template"]["spec"]["containers"][0]
        assert container["resources"]["limits"]["nvidia.com/gpu"] == per_node
        assert "train.py" in container["command"][-1]
    assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", job["metadata"]["name"])


@pytest.mark.slow
@pytest.mark.multiprocess
def test_slurm_script_trains_when_slurms_commands_run_it_here(tmp_path):
    """One node of local_cpu: `scontrol` names this host and `srun` runs its command (Slurm's
    two commands, on a machine without Slurm); the script's own torchrun line then trains."""
    plan = _plan("local_cpu", 1, autopar.ParallelConfig(dp=2, micro_batch_size=2), 4)
    out = tmp_path / "run"
    plan.save(out)
    assert "gpus-per-node" not in (out / "launch.sbatch").read_text()
    shims = tmp_path / "bin"
    shims.mkdir()
    for name, body in {"scontrol": "echo 127.0.0.1", "srun": 'exec "$@"'}.items():
        path = shims / name
        path.write_text(f"#!/bin/bash\n{body}\n")
        path.chmod(path.stat().st_mode | stat.S_IEXEC)
    env = {
        **os.environ,
        "PATH": f"{shims}{os.pathsep}{os.environ['PATH']}",
        "PYTHONPATH": str(REPO),
        "SLURM_JOB_NODELIST": "localhost",
        "SLURM_NNODES": "1",
        "SLURM_JOB_ID": "4242",
        "SLURM_SUBMIT_DIR": str(out),
    }
    done = subprocess.run(
        ["bash", str(out / "launch.sbatch"), "--steps", "2"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    log = (out / "checkpoints" / "log.jsonl").read_text().splitlines()
    assert len(log) == 2  # two steps, logged under the checkpoint directory the script names
