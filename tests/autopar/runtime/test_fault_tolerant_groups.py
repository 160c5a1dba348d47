"""Fault-tolerant replica groups over torchft: a killed group rejoins from a peer, the other
never stops (issue 48, acceptance (a)).

Two groups of two gloo ranks, each its own `torchrun --max-restarts=3` (FSDP2 inside: HSDP
with a fault-tolerant replicate axis; a restart that loses its store's port to another test
tries again), torchft's lighthouse between them, 60 steps of the tiny
Llama on the shipped token file, each batch taking 0.25 s more. Group 1's rank 0 SIGKILLs
itself when it first reads a batch of step 6 or later (tests/autopar/runtime/ft_job.py's data
hook); group 0's all-reduce fails after its 5 s timeout, it drops that step and steps on
alone; torchrun restarts group 1, which waits 5 s more, joins the next quorum and is healed:
its model and optimizer shards copied from group 0's same ranks, its step set to theirs.

Checked: group 0 ran once, no restart, and committed every step from its first to 60 (which
group's first quorum came first is a race: the later one heals into it); group 1's restarted
ranks began past steps group 0 took alone (healed, not from step 1) and ended at 60; at the
end the same rank of both groups holds bitwise the same parameter shards (the program's
digest line), which is what the algorithm promises -- the steps group 1 missed were averaged
over group 0 alone, so the weights are not an uninterrupted run's, and nothing here claims
they are.

And the ranks of a group that stand at different steps after a quorum (a heal that failed
on some of them) stop with the steps named, on 2 real gloo ranks (`group_step`).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from harness import HERE, job_steps, run_group_jobs, run_ranks

from autopar.runtime.collectives import all_reduce_flat
from autopar.runtime.fault_tolerance import group_step
from cost_models.comm import DDP_BUCKET_BYTES

STEPS, KILL_AT = 60, 5  # 0-based: step 6's batch
PACE, DELAY = 0.25, 5.0  # seconds a batch takes; the restarted group waits this long
DIGEST = re.compile(r"replica group (\d), rank (\d): parameters (\w+) after step (\d+)")


@pytest.mark.multiprocess
def test_a_killed_group_rejoins_from_its_peer_while_the_other_keeps_stepping(tmp_path):
    logs = run_group_jobs(min_replicas=1, job=lambda url: [
        "--max-restarts=3", str(HERE / "ft_job.py"), "{group}", url, str(tmp_path),
        str(KILL_AT), str(STEPS), str(PACE), str(DELAY)])  # fmt: skip

    group0, group1, records = job_steps(tmp_path)
    # group 0: one attempt, every step from where it began (the first quorum may have been
    # group 1's alone, group 0 healed into it) to the last, no gap
    assert len(group0) == 2 and all(s == list(range(s[0], STEPS + 1)) for s in group0)
    assert "restarting workers" not in logs[0].lower()  # group 0: one attempt, no restart
    assert len(group1) == 2, records
    # group 1 came back past steps group 0 took alone (healed, not from step 1)
    assert all(s[-1] == STEPS and s[0] > KILL_AT + 2 for s in group1), records
    digests = {}
    for log in logs:
        for g, r, digest, step in DIGEST.findall(log):
            digests[(int(g), int(r))] = (digest, int(step))
    assert digests[(0, 0)] == digests[(1, 0)] and digests[(0, 1)] == digests[(1, 1)]
    assert digests[(0, 0)][1] == STEPS
    print(f"group 1 healed at step {group1[0][0] - 1}; digests {digests}")


def _checkpointing(tmp_path: Path, checkpoints: Path) -> list[str]:
    """Both groups to step 12, checkpointing every 4 into ``checkpoints``; the lighthouse
    waits for both, so the first quorum holds both (the test below)."""
    return run_group_jobs(min_replicas=2, job=lambda url: [
        str(HERE / "ft_job.py"), "{group}", url, str(tmp_path), "999", "12", "0", "0",
        str(checkpoints), "4"])  # fmt: skip


@pytest.mark.multiprocess
def test_a_restarted_job_resumes_each_group_from_its_checkpoint_and_heals_the_one_behind(
    tmp_path,
):
    """Each group checkpoints under its own directory; a whole job started again resumes each
    group from its own newest checkpoint, and the quorum heals the group whose newest is
    older from the other: the end is bitwise an uninterrupted run's.

    Run 1 trains 12 steps, saving at 4, 8 and 12 (group0/ and group1/). Then step 12 is
    deleted from both and step 8 from group 1, as if group 1 had lost its last save: run 2
    resumes group 0 at step 8 and group 1 at step 4; group 1 is healed to step 8 from group 0
    at the first quorum, and both take steps 9-12. Every rank's parameter digest after run 2
    equals its digest after run 1 (same state at step 8, same batches, same averaged
    gradients)."""
    checkpoints = tmp_path / "checkpoints"
    first = _checkpointing(tmp_path, checkpoints)
    ended = {}
    for log in first:
        for g, r, digest, step in DIGEST.findall(log):
            ended[(int(g), int(r))] = (digest, int(step))
    assert set(ended) == {(0, 0), (0, 1), (1, 0), (1, 1)} and ended[(0, 0)][1] == 12
    saved = {g: sorted(p.name for p in (checkpoints / f"group{g}").glob("step-*")) for g in (0, 1)}
    assert saved[0] == saved[1] == ["step-00000004", "step-00000008", "step-00000012"]
    for g in (0, 1):
        shutil.rmtree(checkpoints / f"group{g}" / "step-00000012")
    shutil.rmtree(checkpoints / "group1" / "step-00000008")
    for f in tmp_path.glob("g*r*p*.json"):
        f.unlink()

    second = _checkpointing(tmp_path, checkpoints)
    assert "resumed from" in second[0] and "step-00000008" in second[0]
    assert "step-00000004" in second[1]  # group 1 read its own older checkpoint first ...
    steps = {
        int(re.match(r"g(\d)", f.stem).group(1)): json.loads(f.read_text())["steps"]
        for f in tmp_path.glob("g*r0p*.json")
    }
    assert steps == {0: [9, 10, 11, 12], 1: [9, 10, 11, 12]}  # ... and was healed to step 8
    again = {}
    for log in second:
        for g, r, digest, step in DIGEST.findall(log):
            again[(int(g), int(r))] = (digest, int(step))
    assert again == ended


def test_gradients_are_reduced_in_chunks_each_given_back_its_own_elements():
    """The cross-group all-reduce (`FaultTolerantGroups.sync_gradients`) is the runtime's
    flat one with torchft's reduction in place of a process group's: every gradient gets
    back exactly its own elements reduced, whatever its shape or strides; each dtype is its
    own flat buffer, reduced in chunks of at most DDP_BUCKET_BYTES."""
    big = torch.randn(DDP_BUCKET_BYTES // 4 + 1)  # over one chunk: split in two
    grads = [torch.randn(3, 4), torch.randn(5).double(), torch.randn(4, 3).t(), big,
             torch.randn(2, 2)]  # fmt: skip
    expected = [g * 2 for g in grads]
    calls = []

    def double(t):  # a reduction anyone can check: each element times the group count
        calls.append((t.dtype, t.numel()))
        t.mul_(2)

    all_reduce_flat(grads, None, reduce=double)
    for g, e in zip(grads, expected, strict=True):
        torch.testing.assert_close(g, e, rtol=0, atol=0)
    floats = 12 + 12 + big.numel() + 4
    chunk = DDP_BUCKET_BYTES // 4
    assert calls == [(torch.float32, chunk), (torch.float32, floats - chunk),
                     (torch.float64, 5)]  # fmt: skip


def _steps_of_a_group(offset: int) -> tuple[int, str]:
    import torch.distributed as dist

    step = 7 + offset * dist.get_rank()
    try:
        return group_step(step), ""
    except RuntimeError as error:
        return -1, str(error)


@pytest.mark.multiprocess
def test_ranks_of_a_group_at_different_steps_stop_naming_them():
    assert run_ranks(2, _steps_of_a_group, 0) == [(7, ""), (7, "")]
    (a, why_a), (b, why_b) = run_ranks(2, _steps_of_a_group, 3)
    assert a == b == -1
    assert "steps 7 to 10 after a quorum (this rank: 7)" in why_a and "(this rank: 10)" in why_b
    assert "torchrun restarts it" in why_a
