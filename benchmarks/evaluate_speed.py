"""How fast the cost model prices one configuration once a model's tables exist.

    python3 benchmarks/evaluate_speed.py

Traces Llama 3 8B (seq 8192) once, builds its tables, then prices every valid config of a grid
on 8 DGX H100 nodes (64 GPUs): degrees, ZeRO stage, micro-batch size, schedule, recompute. The
grid is priced twice: the first pass fills the pipeline-simulation and collective caches the way
a search does as it goes; the second shows the cached cost. Target (issue 4): < 1 ms a config.
"""

from __future__ import annotations

import itertools
import time

import autopar
from autopar import Cluster, ConfigError, ParallelConfig
from autopar.estimate import Estimator, build_tables
from autopar.models import hf


def grid(world: int) -> list[ParallelConfig]:
    out = []
    powers = [1, 2, 4, 8, 16, 32, 64]
    for tp, pp, fsdp in itertools.product([1, 2, 4, 8], [1, 2, 4, 8], powers):
        if world % (tp * pp * fsdp):
            continue
        dp = world // (tp * pp * fsdp)
        for zero, mbs, recompute in itertools.product(
            [0, 1, 3], [1, 2], ["none", "selective", "full"]
        ):
            if (fsdp > 1) != (zero > 0):
                continue
            schedules = (
                [("1f1b", 1), ("interleaved_1f1b", 2), ("zero_bubble", 1)]
                if pp > 1
                else [("1f1b", 1)]
            )
            for schedule, v in schedules:
                out.append(
                    ParallelConfig(
                        dp=dp,
                        fsdp=fsdp,
                        tp=tp,
                        pp=pp,
                        zero_stage=zero,
                        micro_batch_size=mbs,
                        schedule=schedule,
                        virtual_stages=v,
                        recompute=recompute,
                        sequence_parallel=tp > 1,
                    )
                )
    return out


def main() -> None:
    model = hf.build("llama3-8b")
    t0 = time.perf_counter()
    graph = autopar.trace(model, hf.example_inputs("llama3-8b", model, seq_len=8192))
    t1 = time.perf_counter()
    tables = build_tables(graph)
    t2 = time.perf_counter()
    cluster = Cluster.from_profile("dgx_h100", num_nodes=8)
    estimator = Estimator(tables, cluster)
    configs = grid(cluster.world_size)
    for label in ("first pass (caches filling)", "second pass (cached)"):
        ok = 0
        start = time.perf_counter()
        for cfg in configs:
            try:
                estimator.evaluate(cfg, 512)
                ok += 1
            except ConfigError:
                pass
        elapsed = time.perf_counter() - start
        print(
            f"{label}: {len(configs)} configs ({ok} valid) in {elapsed:.2f} s = "
            f"{elapsed / len(configs) * 1e3:.3f} ms each, {len(configs) / elapsed:,.0f} configs/s"
        )
    print(f"trace {t1 - t0:.2f} s, tables {t2 - t1:.3f} s (once per model and shape)")


if __name__ == "__main__":
    main()
