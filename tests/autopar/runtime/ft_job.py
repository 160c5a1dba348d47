"""One replica group of the fault-tolerance test, as torchrun starts it.

    torchrun --nproc-per-node=2 --max-restarts=3 ft_job.py GROUP LIGHTHOUSE OUT KILL_AT STEPS \
        PACE DELAY [CHECKPOINT_DIR EVERY [H]]

Trains the tiny Llama under FSDP2 over the group's 2 ranks as one of 2 fault-tolerant replica
groups (autopar.runtime.fault_tolerance) on the shipped token file. Group 1's rank 0 kills its
own process (SIGKILL) when it first reads a batch of step KILL_AT or later, through the data
hook (a marker file stops the restarted process doing it again): torchrun then restarts the
group, which comes back DELAY seconds later (its ranks wait before starting) and rejoins from
group 0. Group 1 starts once group 0 has. Every batch takes PACE seconds more (the data hook
sleeps), so that group 0 has steps to take alone in between. Each rank writes
OUT/g{GROUP}r{RANK}p{PID}.json: the steps it committed; the program's last line per rank
gives its parameters' digest. With CHECKPOINT_DIR the run checkpoints there every EVERY steps
(each group under its own group<g>/, `autopar.runtime.replicas`) and resumes from it,
keeping 3. With H the groups are DiLoCo's (`autopar.runtime.diloco`: an outer step every H,
one fragment), not fault-tolerant ones.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

from autopar.config import ParallelConfig
from autopar.models.source import ZOO_FACTORY
from autopar.runtime.checkpoint import CheckpointOptions
from autopar.runtime.data import TokenFile
from autopar.runtime.diloco import DiLoCoGroup
from autopar.runtime.fault_tolerance import FTGroup
from autopar.runtime.mesh import init_distributed, shutdown_distributed
from autopar.runtime.task import task_from_source
from autopar.runtime.trainer import TrainOptions, train

TOKENS = Path(__file__).resolve().parents[3] / "data" / "tokens" / "autopar-docs.bin"
SEQ, BATCH = 32, 16


def main() -> None:
    group, lighthouse, out, kill_at, steps, pace, delay = sys.argv[1:8]
    group, kill_at, steps, out = int(group), int(kill_at), int(steps), Path(out)
    rank = int(os.environ["RANK"])
    tokens = TokenFile(TOKENS, SEQ, BATCH)
    marker = out / "killed"
    if group == 1 and marker.exists():  # the restarted group: down a while longer
        time.sleep(float(delay))

    def data(step: int, start: int, stop: int):
        if group == 1 and rank == 0 and step >= kill_at and not marker.exists():
            marker.write_text(str(os.getpid()))
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(float(pace))
        return tokens(step, start, stop)

    task = task_from_source(
        ZOO_FACTORY, {"name": "llama-tiny", "vocab_size": 256, "seq_len": SEQ},
        global_batch_size=BATCH, seq_len=SEQ, data=data,
    )  # fmt: skip
    init_distributed("cpu")
    # group 1 starts once group 0 is up: started far apart on a loaded machine, group 1 took
    # the first steps alone, group 0 healed from it just as it died, and group 0's two ranks
    # came out of that heal at different steps (a double failure this test is not about)
    started = out / "g0started"
    if group == 0:
        started.touch()
    while group == 1 and not started.exists():
        time.sleep(0.1)
    checkpoint = diloco = ft = None
    if len(sys.argv) > 8:
        checkpoint = CheckpointOptions(sys.argv[8], every=int(sys.argv[9]), keep=3)
    if len(sys.argv) > 10:
        diloco = DiLoCoGroup(group, 2, lighthouse, inner_steps=int(sys.argv[10]), timeout_s=30)
    else:
        ft = FTGroup(group, 2, lighthouse, min_replicas=1, timeout_s=5.0)
    # every rank prints its digest
    options = TrainOptions(steps=steps, lr=3e-3, ft=ft, diloco=diloco, checkpoint=checkpoint)
    config = ParallelConfig(fsdp=2, zero_stage=3, micro_batch_size=4)
    results = train(task, config, BATCH, options=options)
    record = {"pid": os.getpid(), "steps": [r.step for r in results]}
    (out / f"g{group}r{rank}p{os.getpid()}.json").write_text(json.dumps(record))
    shutdown_distributed()


if __name__ == "__main__":
    main()
