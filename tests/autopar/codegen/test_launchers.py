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
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

import autopar
from autopar.codegen.group_launchers import replica_groups
from autopar.codegen.launchers import pytorchjob_manifest, slurm_script
from autopar.estimate.algorithms import AlgorithmOptions
from autopar.models import zoo
from autopar.plan import Plan
from autopar.plan.training import with_training
from autopar.runtime.replica_groups import ft_timeouts

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
def _shims(tmp_path: Path, srun: str = 'exec "$@"') -> Path:
    """Slurm's two commands on a machine without Slurm: `scontrol` names this host, `srun`
    runs its command."""
    shims = tmp_path / "bin"
    shims.mkdir()
    for name, body in {"scontrol": "echo 127.0.0.1", "srun": srun}.items():
        path = shims / name
        path.write_text(f"#!/bin/bash\n{body}\n")
        path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return shims


def test_slurm_script_trains_when_slurms_commands_run_it_here(tmp_path):
    """One node of local_cpu: `scontrol` names this host and `srun` runs its command (Slurm's
    two commands, on a machine without Slurm); the script's own torchrun line then trains."""
    plan = _plan("local_cpu", 1, autopar.ParallelConfig(dp=2, micro_batch_size=2), 4)
    out = tmp_path / "run"
    plan.save(out)
    assert "gpus-per-node" not in (out / "launch.sbatch").read_text()
    shims = _shims(tmp_path)
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


def _ft_plan(nodes: int = 1, devices: int = 4) -> Plan:
    """HSDP (dp=2 replicas of fsdp 2) with the training record the planner writes when it
    chooses fault-tolerant replica groups: 2 groups of 2 ranks."""
    model = zoo.build("gpt-tiny", device="meta")
    cluster = autopar.Cluster.from_profile("local_cpu", nodes, num_devices=devices)
    config = autopar.ParallelConfig(dp=2, fsdp=cluster.world_size // 2, zero_stage=1)
    inputs = zoo.example_inputs("gpt-tiny", model)
    batch = 2 * cluster.world_size
    plan = autopar.evaluate(model, cluster, config, inputs, global_batch_size=batch,
                            precision="fp32")  # fmt: skip
    return with_training(plan, None, cluster, AlgorithmOptions(choose="ft"), None)


def _free_ports(n: int) -> list[int]:
    import socket

    sockets = [socket.socket() for _ in range(n)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


@pytest.mark.multiprocess
def test_group_launcher_starts_the_lighthouse_and_each_group_here(tmp_path):
    """A plan that chose fault-tolerant groups: its Slurm script starts torchft's lighthouse
    and one torchrun per group, each on its half of the node's devices with its own
    rendezvous, and both groups train through the lighthouse's quorum to the same weights
    (each rank's digest; the lighthouse made to wait for both groups, else one may finish its
    three steps alone first), each logging its steps under its own checkpoint directory, with
    the timeouts ordered collective < quorum < connect."""
    plan = _ft_plan()
    assert plan.training["chosen"]["name"] == "ft" and plan.training["chosen"]["replicas"] == 2
    out = tmp_path / "run"
    plan.save(out)
    text = (out / "launch.sbatch").read_text()
    assert "torchft_lighthouse --min_replicas 1" in text and "--checkpoint-every auto" in text
    # srun's options are --name=value: the shim drops them and runs the command
    shims = _shims(tmp_path, 'while [[ "${1:-}" == -* ]]; do shift; done; exec "$@"')
    lighthouse, rdzv = _free_ports(2)
    env = {
        **os.environ,
        "PATH": f"{shims}{os.pathsep}{os.environ['PATH']}",
        "PYTHONPATH": str(REPO),
        "SLURM_JOB_NODELIST": "localhost",
        "SLURM_NNODES": "1",
        "SLURM_JOB_ID": "4343",
        "SLURM_SUBMIT_DIR": str(out),
        "LIGHTHOUSE_PORT": str(lighthouse),
        "RDZV_PORT": str(rdzv),
        "RUST_LOG": "error",
    }
    # the script's quorum floor is one group (a group steps on alone); raised to both here so
    # that neither can finish alone before the other starts, and the weights must agree
    script = out / "lockstep.sbatch"
    script.write_text(text.replace("--min_replicas 1", "--min_replicas 2"))
    done = subprocess.run(["bash", str(script), "--steps", "3"], env=env,
                          capture_output=True, text=True, timeout=400)  # fmt: skip
    log = done.stdout + done.stderr
    assert done.returncode == 0, log[-3000:]
    digests = re.findall(r"replica group (\d), rank (\d): parameters (\w+) after step (\d+)", log)
    by_rank: dict[str, set[str]] = {}
    for _, rank, digest, step in digests:
        assert step == "3"
        by_rank.setdefault(rank, set()).add(digest)
    assert {g for g, *_ in digests} == {"0", "1"}  # both groups ran to the end
    assert set(by_rank) == {"0", "1"} and all(len(d) == 1 for d in by_rank.values()), digests
    for g in (0, 1):  # each group checkpoints (and logs) under its own directory
        steps = (out / "checkpoints" / f"group{g}" / "log.jsonl").read_text().splitlines()
        assert len(steps) == 3, (g, steps)
    collective, quorum, connect = ft_timeouts(float(re.search(r"--ft-timeout (\S+)", text)[1]))
    assert collective < quorum < connect


def test_group_launchers_lay_groups_on_nodes_and_kubernetes():
    """Two groups on two nodes: each its own node and rendezvous; on Kubernetes a lighthouse
    Deployment and Service and one PyTorchJob per group, each pointed at the Service; a
    layout the groups cannot split is said, not launched wrong."""
    plan = _ft_plan(nodes=2, devices=None)
    text = slurm_script(plan)
    subprocess.run(["bash", "-n"], input=text, text=True, check=True)
    per_node = plan.world_size // plan.num_nodes
    assert f"--nnodes 1 --nproc-per-node {per_node}" in text and "first=$((g * 1))" in text
    docs = list(yaml.safe_load_all(pytorchjob_manifest(plan)))
    assert [d["kind"] for d in docs] == ["Deployment", "Service", "PyTorchJob", "PyTorchJob"]
    service = docs[1]["metadata"]["name"]
    for g, job in enumerate(docs[2:]):
        master = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]
        (command,) = [c["command"][2] for c in master["containers"]]
        assert f"--ft-group {g} --ft-groups 2" in command and f"http://{service}:29510" in command
        assert "Worker" not in job["spec"]["pytorchReplicaSpecs"]  # one node a group
    odd = replace(plan, training={"chosen": {**plan.training["chosen"], "replicas": 3}})
    with pytest.raises(ValueError, match="start each group by hand"):
        replica_groups(odd)
    assert "start each group by hand" in slurm_script(odd)


def test_diloco_launcher_is_one_sites_and_asks_for_the_lighthouse(tmp_path):
    """A DiLoCo plan is one site's group: its script trains that site's group GROUP, starts the
    lighthouse at site 0 only, and elsewhere stops with what to set (run here: GROUP=1 without
    LIGHTHOUSE exits 2 naming it); on Kubernetes the job's group comes from GROUP too."""
    model = zoo.build("gpt-tiny", device="meta")
    inputs = zoo.example_inputs("gpt-tiny", model)
    site = autopar.Cluster.from_profile("dgx_h100", 1)
    both = autopar.Cluster.from_profile("dgx_h100", 2, sites=2, site_link_gbps=1)
    plan = autopar.evaluate(model, site, autopar.ParallelConfig(dp=8), inputs,
                            global_batch_size=8, precision="fp32")  # fmt: skip
    plan = with_training(plan, plan, both, AlgorithmOptions(choose="diloco"), None)
    assert plan.training["chosen"]["name"] == "diloco"
    text = slurm_script(plan)
    assert "torchft_lighthouse --min_replicas 2" in text and '--diloco-group "$g"' in text
    assert '--checkpoint-dir "$SLURM_SUBMIT_DIR/checkpoints"' in text  # each group its own
    script = tmp_path / "launch.sbatch"
    script.write_text(text)
    env = {**os.environ, "PATH": f"{_shims(tmp_path)}{os.pathsep}{os.environ['PATH']}",
           "SLURM_JOB_NODELIST": "localhost", "GROUP": "1"}  # fmt: skip
    env.pop("LIGHTHOUSE", None)
    done = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True)
    assert done.returncode == 2 and "GROUP=1 needs LIGHTHOUSE=http://HOST:PORT" in done.stderr
    docs = list(yaml.safe_load_all(pytorchjob_manifest(plan)))
    assert [d["kind"] for d in docs] == ["Deployment", "Service", "PyTorchJob"]
    assert "--diloco-group ${GROUP:-0} --diloco-groups 2" in str(docs[2])
