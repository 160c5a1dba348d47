"""The README's main job, as far as the project goes today.

In: a Hugging Face model preset and a shipped cluster profile. Out: printed text: the cluster,
the traced model's layer table, the plan `parallelize` finds (summary and explanation), and the
plan saved as JSON. Code generation and the run on local CPU ranks join this job with issue 6.
"""

from __future__ import annotations

import time
from pathlib import Path


def run_demo(
    model_name: str = "llama3-8b",
    profile: str = "dgx_h100",
    num_nodes: int = 2,
    seq_len: int = 8192,
    out_dir: str | None = None,
) -> str:
    """Plan ``model_name`` (an `autopar.models.hf` preset, built on meta) on the cluster."""
    import autopar
    from autopar.models import hf

    cluster = autopar.Cluster.from_profile(profile, num_nodes=num_nodes)
    lines = [cluster.as_text(), ""]
    start = time.perf_counter()
    model = hf.build(model_name)
    inputs = hf.example_inputs(model_name, model, seq_len=seq_len)
    graph = autopar.trace(model, inputs)
    lines += [graph.as_text(), ""]
    plan = autopar.parallelize(model, cluster, graph=graph)
    lines += [plan.summary(), "", plan.explain(), ""]
    if out_dir is not None:
        path = plan.save(Path(out_dir))
        lines.append(f"plan written to {path}")
    lines.append(f"traced and planned in {time.perf_counter() - start:.1f} s")
    lines.append("(code generation and the local CPU run join this job with issue 6)")
    return "\n".join(lines)
