"""Overhead of the generated program against a hand-written torch program of the same plan.

    python3 benchmarks/runtime_overhead.py [--steps 12] [--repeats 3]

The plan: a Llama (the zoo's llama-tiny widened: hidden 256, 4 layers, seq 128, vocab 1024)
under DP2 x TP2 on 4 CPU ranks (gloo), fp32, global batch 8 in micro-batches of 2. The same
model (same seed), data, steps and plan run twice under torchrun:

    generated     autopar.evaluate -> plan.save -> torchrun out/overhead/train.py (autopar.runtime)
    hand-written  this file with --handwritten: init_device_mesh, parallelize_module with
                  Colwise/Rowwise/PrepareModuleInput and a vocabulary-parallel embedding/head
                  under loss_parallel, a manual flat all-reduce over dp, the global-norm clip,
                  AdamW -- plain torch, nothing from autopar.runtime

Each run prints per-step wall times; a run's time is the median over its steps after the first
two (warm-up), and each program's the median over the repeats (run alternately, so load on the
shared machine hits both alike). Printed: both, and the ratio generated / hand-written (the
target is <= 1.05). Pipeline parallelism is not in the plan yet: the trainer does not drive
`autopar.runtime.pipeline` (see the closing notes of issue 6).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OVERRIDES = {
    "hidden": 256,
    "num_layers": 4,
    "ffn_hidden": 688,
    "num_heads": 8,
    "num_kv_heads": 4,
    "seq_len": 128,
    "vocab_size": 1024,
}
DP, TP, MBS, BATCH = 2, 2, 2, 8
STEP_LINE = re.compile(r"^step (\d+)/\d+ .*time (\S+) s", re.M)


def handwritten(steps: int) -> None:
    """The same plan with torch's APIs only (run under torchrun with 4 ranks)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        loss_parallel,
        parallelize_module,
    )

    from autopar.models import zoo  # the model only: the same seeded weights

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (DP, TP), mesh_dim_names=("dp", "tp"))
    model = zoo.build("llama-tiny", **OVERRIDES)
    shared = PrepareModuleInput(  # q/k/v (gate/up) share one input: one grad all-reduce
        input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),), use_local_output=False
    )
    attn_in = PrepareModuleInput(
        input_layouts=(Replicate(), None, None),
        desired_input_layouts=(Replicate(), None, None),
        use_local_output=False,
    )
    plan = {
        "embed_tokens": RowwiseParallel(input_layouts=Replicate()),
        "lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
    }
    for i in range(OVERRIDES["num_layers"]):
        p = f"layers.{i}"
        plan |= {
            f"{p}.self_attn": attn_in,
            f"{p}.self_attn.q_proj": ColwiseParallel(),
            f"{p}.self_attn.k_proj": ColwiseParallel(),
            f"{p}.self_attn.v_proj": ColwiseParallel(),
            f"{p}.self_attn.o_proj": RowwiseParallel(),
            f"{p}.mlp": shared,
            f"{p}.mlp.gate_proj": ColwiseParallel(),
            f"{p}.mlp.up_proj": ColwiseParallel(),
            f"{p}.mlp.down_proj": RowwiseParallel(),
        }
    parallelize_module(model, mesh["tp"], plan)
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, foreach=False)
    dp_rank, dp_group = mesh.get_local_rank("dp"), mesh["dp"].get_group()
    per_rank = BATCH // DP
    num_micro = per_rank // MBS

    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if isinstance(t, DTensor) else t

    for step in range(steps):
        t0 = time.perf_counter()
        inputs, targets = zoo.example_batch("llama-tiny", model, batch_size=BATCH, seed=step)
        (ids,) = inputs
        ids, targets = (t[dp_rank * per_rank : (dp_rank + 1) * per_rank] for t in (ids, targets))
        loss_sum = 0.0
        for i in range(num_micro):
            mb = slice(i * MBS, (i + 1) * MBS)
            with loss_parallel():
                loss = zoo.lm_loss(model(ids[mb]), targets[mb]) / num_micro
                loss.backward()
            loss_sum += local(loss.detach()).item()
        for p in params:  # the embedding's replicated gradient -> its vocabulary shard
            if isinstance(p.grad, DTensor) and p.grad.placements != p.placements:
                p.grad = p.grad.redistribute(p.device_mesh, p.placements)
        grads = [local(p.grad) for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=dp_group)
        flat.div_(DP)
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()
        total = torch.zeros(2, dtype=torch.float64)
        for p, g in zip(params, grads, strict=True):
            sharded = isinstance(p, DTensor) and p.placements[0].is_shard()
            total[0] += g.double().pow(2).sum() * ((1 if sharded else 1 / TP) / DP)
        total[1] = loss_sum / (DP * TP)
        dist.all_reduce(total)
        norm = total[0].sqrt().item()
        coef = min(1.0, 1.0 / (norm + 1e-6))
        with torch.no_grad():
            for g in grads:
                g.mul_(coef)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if dist.get_rank() == 0:
            print(
                f"step {step + 1}/{steps}  loss {total[1].item():.6f}  grad_norm {norm:.6f}  "
                f"time {time.perf_counter() - t0:.4f} s",
                flush=True,
            )
    dist.destroy_process_group()


def _torchrun(script: Path, steps: int) -> tuple[list[float], list[float]]:
    """(per-step times, losses) of one torchrun of ``script`` on 4 ranks."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4"]
    cmd += [str(script), "--steps", str(steps)]
    if script.resolve() == Path(__file__).resolve():
        cmd.append("--handwritten")
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    if done.returncode:
        raise RuntimeError(f"{script} failed:\n{done.stderr[-3000:]}")
    times = [float(t) for _, t in STEP_LINE.findall(done.stdout)]
    losses = [float(x) for x in re.findall(r"loss (\S+)", done.stdout)]
    return times, losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--handwritten", action="store_true", help="(under torchrun) run it")
    parser.add_argument("--out", default=str(REPO / "out" / "overhead"))
    args = parser.parse_args()
    if args.handwritten:
        handwritten(args.steps)
        return
    sys.path.insert(0, str(REPO))
    import autopar
    from autopar.models import zoo

    model = zoo.build("llama-tiny", **OVERRIDES)
    cluster = autopar.Cluster.from_profile("local_cpu", 1, num_devices=DP * TP)
    config = autopar.ParallelConfig(dp=DP, tp=TP, micro_batch_size=MBS)
    inputs = zoo.example_inputs("llama-tiny", model)
    plan = autopar.evaluate(
        model, cluster, config, inputs, global_batch_size=BATCH, precision="fp32"
    )
    plan.save(args.out)
    runs: dict[str, list[float]] = {"generated": [], "hand-written": []}
    scripts = {"generated": Path(args.out) / "train.py", "hand-written": Path(__file__)}
    losses = {}
    for _ in range(args.repeats):
        for name, script in scripts.items():
            times, losses[name] = _torchrun(script, args.steps)
            runs[name].append(statistics.median(times[2:]))
    gen, hand = (statistics.median(runs[k]) for k in ("generated", "hand-written"))
    print(f"plan {config.as_text()} on 4 CPU ranks (gloo), {args.steps} steps x {args.repeats}")
    for name, per_run in runs.items():
        shown = ", ".join(f"{t * 1e3:.1f}" for t in per_run)
        print(f"{name:13} median step {statistics.median(per_run) * 1e3:7.1f} ms  (runs: {shown})")
    same = max(abs(a - b) for a, b in zip(losses["generated"], losses["hand-written"], strict=True))
    print(f"losses agree within {same:.1e}")
    print(f"ratio generated / hand-written = {gen / hand:.3f}  (target <= 1.05)")


if __name__ == "__main__":
    main()
