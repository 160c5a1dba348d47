"""Hand-written torch programs of the overhead benchmark's plans: the yardstick for autopar's.

In: a `Shape` (dp x tp x pp, pipeline stages outermost, tensor parallelism innermost, as the
generated program's mesh), the zoo Llama's size overrides, the global batch, the micro-batch
size and the number of steps; run on every rank of a gloo world (torchrun's environment, or
ranks whose process group already exists). Out: on rank 0, one line per step in the generated
program's format (`step i/n  loss L  grad_norm G  time T s`); every rank returns the per-step
(loss, time).

Written plainly against torch -- nothing of `autopar.runtime` -- so that
`benchmarks/runtime_overhead.py` measures the generated program's overhead; only the model
and the data come from `autopar.models.zoo` (same seeded weights, same batches, so the losses
of the two programs can be held against each other):

    mesh      init_device_mesh("cpu", (pp, dp, tp))
    TP        parallelize_module: q/k/v and gate/up ColwiseParallel, o/down RowwiseParallel,
              each attention/MLP input prepared once (PrepareModuleInput: one all-reduce of the
              input gradient, as Megatron's f); without pipeline stages a vocabulary-parallel
              embedding (RowwiseParallel) and head (ColwiseParallel) under loss_parallel; with
              them the embedding and head are replicated (the schedule's loss runs outside
              loss_parallel)
    PP        the layers cut evenly into pp `Chunk`s, one `PipelineStage` each, driven by
              `Schedule1F1B`; the loss is the micro-batch mean / m with scale_grads=False
    DP        one flat all-reduce of every gradient over dp, divided by dp
    clip      one all-reduce over the world of [sum of squared gradients weighted by how many
              ranks hold each, loss / world]; grads *= min(1, 1 / (norm + 1e-6)); AdamW
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import PipelineStage, Schedule1F1B
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    loss_parallel,
    parallelize_module,
)

from autopar.models import zoo
from autopar.models.layers import rope_cos_sin
from autopar.models.source import ZOO_FACTORY
from autopar.runtime.startup.start import build_whole
from autopar.runtime.task import task_from_source

MODEL = "llama-tiny"


@dataclass(frozen=True)
class Shape:
    """Degrees of the plan: data, tensor and pipeline parallelism."""

    dp: int = 1
    tp: int = 1
    pp: int = 1

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def label(self) -> str:
        parts = [f"{n.upper()}{d}" for n, d in (("dp", self.dp), ("pp", self.pp), ("tp", self.tp))]
        return "x".join(p for p in parts if not p.endswith("1")) or "single"


class Chunk(nn.Module):
    """Layers [lo, hi) of the zoo Llama, with the embedding on the first chunk and the final
    norm and head on the last: what one pipeline stage runs."""

    def __init__(self, model: nn.Module, lo: int, hi: int, first: bool, last: bool) -> None:
        super().__init__()
        self.config = model.config
        self.embed_tokens = model.embed_tokens if first else None
        self.layers = nn.ModuleDict({str(i): model.layers[i] for i in range(lo, hi)})
        self.norm = model.norm if last else None
        self.lm_head = model.lm_head if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed_tokens is not None:
            x = self.embed_tokens(x)
        cfg = self.config
        cos, sin = rope_cos_sin(x.shape[1], cfg.hidden // cfg.num_heads, cfg.rope_theta, x.device)
        for layer in self.layers.values():
            x = layer(x, cos, sin)
        if self.lm_head is not None:
            x = self.lm_head(self.norm(x))
        return x


def tp_plan(layer_indices: range, vocab_parallel: bool) -> dict:
    """Megatron's tensor-parallel rules for the zoo Llama's layers ``layer_indices``."""
    shared = PrepareModuleInput(  # q/k/v (gate/up) share one input: one grad all-reduce
        input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),), use_local_output=False
    )
    attn_in = PrepareModuleInput(
        input_layouts=(Replicate(), None, None),
        desired_input_layouts=(Replicate(), None, None),
        use_local_output=False,
    )
    plan: dict = {}
    if vocab_parallel:
        plan["embed_tokens"] = RowwiseParallel(input_layouts=Replicate())
        plan["lm_head"] = ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
    for i in layer_indices:
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
    return plan


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def run(
    shape: Shape, steps: int, overrides: dict, batch: int, micro_batch: int
) -> list[tuple[float, float]]:
    """Train ``steps`` steps of the zoo Llama under ``shape``; per step (loss, seconds)."""
    owns_group = not dist.is_initialized()
    if owns_group:
        dist.init_process_group("gloo")
    names = ("pp", "dp", "tp")
    mesh = init_device_mesh("cpu", (shape.pp, shape.dp, shape.tp), mesh_dim_names=names)
    # the weights autopar's programs start from (its init, replayed: `autopar.runtime.startup`),
    # so that the two programs' losses can be compared; built whole, as a hand-written
    # program of this size does
    model = build_whole(task_from_source(ZOO_FACTORY, {"name": MODEL, **overrides},
                                         global_batch_size=batch))  # fmt: skip
    num_layers = model.config.num_layers
    pp_rank = mesh.get_local_rank("pp")
    per_rank = batch // shape.dp
    num_micro = per_rank // micro_batch
    if shape.pp > 1:
        lo, hi = pp_rank * num_layers // shape.pp, (pp_rank + 1) * num_layers // shape.pp
        first, last = pp_rank == 0, pp_rank == shape.pp - 1
        module: nn.Module = Chunk(model, lo, hi, first, last)
        parallelize_module(module, mesh["tp"], tp_plan(range(lo, hi), vocab_parallel=False))
        pp_group = mesh["pp"].get_group()
        stage = PipelineStage(module, pp_rank, shape.pp, torch.device("cpu"), group=pp_group)

        def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            return zoo.lm_loss(out, target) / num_micro

        schedule = Schedule1F1B(stage, num_micro, loss_fn=loss_fn, scale_grads=False)
    else:
        first = last = True
        module = model
        parallelize_module(module, mesh["tp"], tp_plan(range(num_layers), vocab_parallel=True))
    params = list(module.parameters())
    opt = torch.optim.AdamW(params, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, foreach=False)
    dp_rank, dp_group = mesh.get_local_rank("dp"), mesh["dp"].get_group()
    out = []
    for step in range(steps):
        t0 = time.perf_counter()
        inputs, targets = zoo.example_batch(MODEL, model, batch_size=batch, seed=step)
        (ids,) = inputs
        ids, targets = (t[dp_rank * per_rank : (dp_rank + 1) * per_rank] for t in (ids, targets))
        loss = torch.zeros((), dtype=torch.float32 if shape.pp > 1 else torch.float64)
        if shape.pp > 1:
            losses: list[torch.Tensor] = []
            args = (ids,) if first else ()
            schedule.step(*args, target=targets if last else None, losses=losses)
            if last:
                loss = torch.stack([_local(x).detach().float() for x in losses]).sum()
            dist.broadcast(loss, group_src=shape.pp - 1, group=mesh["pp"].get_group())
        else:
            for i in range(num_micro):
                mb = slice(i * micro_batch, (i + 1) * micro_batch)
                with loss_parallel():
                    micro = zoo.lm_loss(module(ids[mb]), targets[mb]) / num_micro
                    micro.backward()
                loss += _local(micro.detach())
            for p in params:  # the embedding's replicated gradient -> its vocabulary shard
                if isinstance(p.grad, DTensor) and p.grad.placements != p.placements:
                    p.grad = p.grad.redistribute(p.device_mesh, p.placements)
        grads = [_local(p.grad) for p in params]
        if shape.dp > 1:
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, group=dp_group)  # gloo has no AVG: sum, then divide
            flat.div_(shape.dp)
            offset = 0
            for g in grads:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()
        total = torch.zeros(2, dtype=torch.float64)
        for p, g in zip(params, grads, strict=True):
            sharded = isinstance(p, DTensor) and p.placements[0].is_shard()
            total[0] += g.double().pow(2).sum() * ((1 if sharded else 1 / shape.tp) / shape.dp)
        total[1] = loss.double() / shape.world_size
        dist.all_reduce(total)
        norm = total[0].sqrt().item()
        coef = min(1.0, 1.0 / (norm + 1e-6))
        with torch.no_grad():
            for g in grads:
                g.mul_(coef)
        opt.step()
        opt.zero_grad(set_to_none=True)
        seconds = time.perf_counter() - t0
        out.append((total[1].item(), seconds))
        if dist.get_rank() == 0:
            print(
                f"step {step + 1}/{steps}  loss {total[1].item():.6f}  grad_norm {norm:.6f}  "
                f"time {seconds:.4f} s",
                flush=True,
            )
    dist.barrier()  # no rank leaves with a peer's send in flight
    if owns_group:
        dist.destroy_process_group()
    return out
