"""DiLoCo over torchft: two replica groups of two gloo ranks, H = 8, on the shipped token file.

Each group is its own torch.distributed world (FSDP2 over its 2 ranks) training its half of
the global batch; every 8 inner steps torchft's DiLoCo all-reduces each rank's shard of the
pseudo-gradient with the other group's through a lighthouse's quorum and takes the outer
Nesterov step. Checked:
- the bytes between the groups, counted as torchft's Manager is handed them, flow at steps 8
  and 16 only and equal the plan's DiLoCo figure exactly (`estimate.algorithms`: P x 4 bytes an
  outer step, 1/H of the synchronous gradient sum the plan prices for the same ranks with dp
  across the two sites);
- the loss over the second outer period, averaged over both groups, is within 5% of
  synchronous data parallelism's over the same steps (4 ranks, dp=2 x fsdp=2, same batch,
  same learning rate; measured 3.73 against 3.82 when written);
- a run stopped and started again from its checkpoint takes the same outer steps, bitwise, as
  one never stopped (the outer state -- each fragment's last outer parameters, the momentum,
  torchft's step -- saved beside the model);
- a group behind the others (its newest checkpoint lost, or killed mid-run) is healed to their
  step at its first outer step: the outer state, and with 2 fragments the peer's model shards.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from diloco_ranks import BATCH, MODEL, SEQ, diloco_rank, sync_rank
from harness import HERE, job_steps, run_group_jobs, run_groups, run_ranks

import autopar
from autopar.config import ParallelConfig as C
from autopar.estimate.algorithms import AlgorithmOptions, cross_site_bytes, price_diloco
from autopar.models import zoo
from autopar.runtime.checkpoint import CheckpointOptions

H, STEPS = 8, 16
LOSS_BOUND = 0.05


@pytest.mark.multiprocess
def test_diloco_sends_one_h_th_of_the_gradient_sum_and_tracks_synchronous_loss():
    torchft = pytest.importorskip("torchft._torchft")
    lighthouse = torchft.LighthouseServer(bind="[::]:0", min_replicas=2)
    try:  # one micro-batch a step: the synchronous gradient sum runs once a step
        ranks = run_groups(
            2, 2, diloco_rank, C(fsdp=2, zero_stage=3, micro_batch_size=4), STEPS,
            lighthouse.address(), H,
        )  # fmt: skip
    finally:
        lighthouse.shutdown()
    cfg = C(dp=2, fsdp=2, zero_stage=3, micro_batch_size=4)
    sync = run_ranks(4, sync_rank, cfg, STEPS)[0]

    # the plan's figures for these ranks: two sites of two, dp across them
    model = zoo.build(
        "llama-tiny", device="meta", **{k: v for k, v in MODEL.items() if k != "name"}
    )
    (ids,) = zoo.example_inputs("llama-tiny", model)
    sites = autopar.Cluster.from_profile(
        "local_cpu", 2, devices_per_node=2, sites=2, site_link_gbps=1
    )
    plan = autopar.evaluate(
        model, sites, cfg, (ids[:, :SEQ],), global_batch_size=BATCH, precision="fp32"
    )
    sync_bytes = cross_site_bytes(plan.communication, cfg, sites) - 16  # less the clip's sum
    planned = price_diloco(
        plan.step_time_s, cfg, BATCH * SEQ, 1e9, sites, None, plan.num_params, "adamw",
        AlgorithmOptions(), H, 1,
    ).cross_site_bytes_per_step  # fmt: skip

    for rank in ranks:  # bytes only at the outer steps
        assert [step for step, _, b in rank if b] == [H, 2 * H]
    group_bytes = sum(b for rank in ranks[:2] for *_, b in rank)  # group 0's two shards
    assert group_bytes == sum(b for rank in ranks[2:] for *_, b in rank)
    assert group_bytes / STEPS == planned == plan.num_params * 4 / H
    assert planned == pytest.approx(sync_bytes / H, rel=1e-12)

    # the second outer period's loss, both groups' halves of the batch averaged
    late = slice(H, STEPS)
    diloco = sum(loss for rank in (ranks[0], ranks[2]) for _, loss, _ in rank[late]) / (2 * H)
    synchronous = sum(sync[late]) / H
    print(f"loss over steps {H + 1}-{STEPS}: DiLoCo {diloco:.4f}, synchronous {synchronous:.4f}")
    assert abs(diloco - synchronous) <= LOSS_BOUND * synchronous


@pytest.mark.multiprocess
def test_a_diloco_run_resumed_from_its_checkpoint_takes_the_outer_steps_of_one_never_stopped(
    tmp_path,
):
    """H = 4 in 2 fragments, streamed: a fragment syncs every 2 steps, in turn, its all-reduce
    started a step ahead. Asked to checkpoint every 6 steps, the run saves at whole outer
    periods only (8); run again to step 12, it resumes there. Step 9 starts fragment 0's
    all-reduce (its pseudo-gradient from its outer parameters of step 6), step 10 takes its
    outer step (its momentum from steps 2 and 6), so the losses of steps 11 and 12 equal the
    uninterrupted run's only if those came back. torchft's step, which picks the fragment, is
    read from the file: at a multiple of H its parity is the same either way."""
    torchft = pytest.importorskip("torchft._torchft")
    cfg = C(fsdp=2, zero_stage=3, micro_batch_size=4)
    checkpoint = CheckpointOptions(str(tmp_path), every=6)
    runs = []
    for _ in range(2):  # straight through, saving; then again from the checkpoint
        lighthouse = torchft.LighthouseServer(bind="[::]:0", min_replicas=2)
        try:
            runs.append(
                run_groups(2, 2, diloco_rank, cfg, 12, lighthouse.address(), 4, 2, checkpoint)
            )
        finally:
            lighthouse.shutdown()
    straight, resumed = runs
    for g in (0, 1):  # each group its own checkpoint, each rank its own outer state
        saved = sorted(p.name for p in (tmp_path / f"group{g}").glob("step-*"))
        assert saved == ["step-00000008"]
        assert {p.name for p in (tmp_path / f"group{g}" / saved[0]).glob("extra-rank*.pt")} == {
            "extra-rank0.pt",
            "extra-rank1.pt",
        }
    state = torch.load(tmp_path / "group1" / "step-00000008" / "extra-rank1.pt")
    assert state["torchft"]["torchft"]["step"] == 4  # fragment syncs at steps 2, 4, 6 and 8
    assert state["local_step"] == 0  # none in flight
    assert all(s["outer_optimizer"]["state"] for s in state["torchft"]["user"].values())
    for before, after in zip(straight, resumed, strict=True):
        assert [step for step, *_ in after] == [9, 10, 11, 12]
        assert after == before[8:]  # losses and bytes between groups, bitwise
        assert sum(b for *_, b in after) > 0  # outer steps in the resumed stretch


def _resumed_with_group_1_behind(tmp_path, fragments: int) -> tuple[list, list]:
    """Per rank, (step, loss, outer bytes) of a 12-step run of two groups, H = 4, saving at 4,
    8 and 12; then of the same job started again after step 12 is deleted from both groups and
    step 8 from group 1 (ranks 0-1 are group 0's, 2-3 group 1's)."""
    torchft = pytest.importorskip("torchft._torchft")
    cfg = C(fsdp=2, zero_stage=3, micro_batch_size=4)
    checkpoint = CheckpointOptions(str(tmp_path), every=4, keep=3)

    def run():
        lighthouse = torchft.LighthouseServer(bind="[::]:0", min_replicas=2)
        try:
            return run_groups(
                2, 2, diloco_rank, cfg, 12, lighthouse.address(), 4, fragments, checkpoint
            )
        finally:
            lighthouse.shutdown()

    straight = run()
    for g in (0, 1):
        shutil.rmtree(tmp_path / f"group{g}" / "step-00000012")
    shutil.rmtree(tmp_path / "group1" / "step-00000008")
    return straight, run()


@pytest.mark.multiprocess
def test_a_diloco_group_behind_the_others_is_healed_to_their_step(tmp_path):
    """One site lost its newest checkpoint: H = 4, one fragment, saves at 4, 8 and 12; then
    step 12 is deleted from both groups and step 8 from group 1, and the job is started again.
    Group 0 resumes at 8 and takes steps 9-12; group 1 resumes at 4 and takes 5-8 meanwhile
    (its own checkpoint's state: those steps are the uninterrupted run's, bitwise). At their
    first outer step -- group 0's at 12, group 1's at 8, the same quorum -- group 1 is healed to
    group 0's state at 12 (`diloco.Position`), so its loop ends there with group 0's, and its
    checkpoint is labelled 12. Group 0's losses are the uninterrupted run's too (nothing of
    group 1's reaches it before that outer step); after it both groups hold the same outer
    parameters and torchft step (their step-12 outer state), which they would not had group 1
    kept its step-4 ones."""
    straight, resumed = _resumed_with_group_1_behind(tmp_path, fragments=1)
    for before, after in zip(straight[:2], resumed[:2], strict=True):
        assert after == before[8:]  # steps 9-12
    for before, after in zip(straight[2:], resumed[2:], strict=True):
        assert after == before[4:8]  # steps 5-8, then healed to 12: done
    for r in (0, 1):
        states = [
            torch.load(tmp_path / f"group{g}" / "step-00000012" / f"extra-rank{r}.pt")["torchft"]
            for g in (0, 1)
        ]
        assert states[0]["torchft"] == states[1]["torchft"] == {"step": 3, "batches_committed": 6}
        ours, theirs = (s["user"]["StreamingDiLoCoFragment_0"] for s in states)
        assert ours["original_parameters"].keys() == theirs["original_parameters"].keys()
        for name, value in ours["original_parameters"].items():
            assert torch.equal(value, theirs["original_parameters"][name]), name


@pytest.mark.multiprocess
def test_a_group_behind_takes_a_peers_model_shards_with_its_fragments_outer_state(tmp_path):
    """As above with 2 fragments, streamed: H = 4, a fragment syncs every 2 steps in turn, its
    all-reduce started a step ahead. Group 1 resumes at 4 and meets group 0, resumed at 8, at
    its first fragment all-reduce: group 0's for step 10, started in step 9; group 1's for
    step 6, started in step 5. Group 1 is healed there to group 0's step 9 and runs 10-12.

    Between two syncs of a fragment the other one trains on, so the model a healed group
    takes is not the outer state alone: the peer's local shards of every fragment and their
    optimizer moments come with it (`replica_groups.LocalShards`). Checked through the losses:
    group 1's steps after the heal are within 1% of the uninterrupted run's (the peer's model
    a step ahead of where its own stood; measured 0.06-0.2% when written), where keeping its
    own step-5 shards of the fragment not being synced put step 10 17% over. Group 0's steps
    9 and 10 and group 1's step 5 are the uninterrupted run's bitwise (no state of the other
    group has reached them yet), and both groups save step 12 with the same outer state of
    each fragment and torchft step."""
    straight, resumed = _resumed_with_group_1_behind(tmp_path, fragments=2)
    for before, after in zip(straight[:2], resumed[:2], strict=True):
        assert [step for step, *_ in after] == [9, 10, 11, 12]
        assert after[:2] == before[8:10]
    for before, after in zip(straight[2:], resumed[2:], strict=True):
        assert [step for step, *_ in after] == [5, 10, 11, 12]
        assert after[0] == before[4]
        for (step, loss, _), (_, want, _) in zip(after[1:], before[9:], strict=True):
            assert loss == pytest.approx(want, rel=0.01), (step, loss, want)
    for r in (0, 1):
        states = [
            torch.load(tmp_path / f"group{g}" / "step-00000012" / f"extra-rank{r}.pt")["torchft"]
            for g in (0, 1)
        ]
        assert states[0]["torchft"] == states[1]["torchft"] == {"step": 6, "batches_committed": 12}
        for fragment in ("StreamingDiLoCoFragment_0", "StreamingDiLoCoFragment_1"):
            ours, theirs = (s["user"][fragment]["original_parameters"] for s in states)
            assert ours.keys() == theirs.keys()
            for name, value in ours.items():
                assert torch.equal(value, theirs[name]), (fragment, name)


@pytest.mark.multiprocess
def test_a_killed_diloco_group_restarts_and_rejoins_at_the_others_step(tmp_path):
    """Two DiLoCo groups of ft_job.py, each its own torchrun --max-restarts, H = 4, 24 steps,
    a checkpoint every 8. Group 1's rank 0 SIGKILLs itself reading step 14's batch; torchrun
    restarts the group, which resumes from its step 8 -- a period behind group 0, which waits
    in its quorum at step 16 for it (DiLoCo's outer steps take every group). Group 1 meets that
    quorum at its first outer step (after steps 9-12), is healed there to group 0's step 16
    (model and optimizer shards, outer state, `diloco.Position`), and goes on from 17. torchft's
    synchronous quorum counts a group healed in it as taking part, and group 1's
    pseudo-gradient at 16 is group 0's own (it holds group 0's state), so that outer step is
    group 0's period alone; the steps 13-16 group 1 lost are not in it.

    Checked: group 0 ran once and took steps 1-24; group 1's restarted ranks took 9-12, then
    17-24; at step 24 both groups hold the same outer parameters and torchft step (their
    step-24 outer state): 6 outer steps, every 4 inner steps."""
    checkpoints = tmp_path / "checkpoints"
    logs = run_group_jobs(min_replicas=2, job=lambda url: [
        "--max-restarts=3", str(HERE / "ft_job.py"), "{group}", url, str(tmp_path), "13",
        "24", "0", "0", str(checkpoints), "8", "4"])  # fmt: skip

    group0, group1, records = job_steps(tmp_path)
    assert group0 == [list(range(1, 25))] * 2, records
    assert "restarting workers" not in logs[0].lower()
    assert group1 == [[9, 10, 11, 12, *range(17, 25)]] * 2, records
    assert "healed from a peer at its step 16 (this group stood at 12)" in logs[1]
    for r in (0, 1):
        states = [
            torch.load(checkpoints / f"group{g}" / "step-00000024" / f"extra-rank{r}.pt")
            for g in (0, 1)
        ]
        ours, theirs = (s["torchft"] for s in states)
        assert ours["torchft"]["step"] == theirs["torchft"]["step"] == 6
        ours, theirs = (s["user"]["StreamingDiLoCoFragment_0"] for s in (ours, theirs))
        for name, value in ours["original_parameters"].items():
            assert torch.equal(value, theirs["original_parameters"][name]), name
