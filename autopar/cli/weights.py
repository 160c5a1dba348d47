"""`autopar export-hf CHECKPOINT --out DIR`: a training run's checkpoint as Hugging Face weights.

In: an autopar checkpoint (`train.py --checkpoint-dir`'s directory, whose newest intact
checkpoint is taken, or one `step-N` directory) and the model's config: from the plan the run
trained (`--plan plan.json`: its model rebuilt on meta), or a config.json (`--config`). Out:
DIR holding config.json and model.safetensors (or shards and an index) that transformers'
`from_pretrained` loads (`autopar.runtime.hf_export`), in fp32 or `--dtype bfloat16`.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from autopar.errors import AutoparError


def run_export_hf(args: argparse.Namespace) -> str:
    import torch

    from autopar.runtime.hf_export import export_hf

    config: Any = None
    if args.config:
        config = Path(args.config)
        if not config.is_file():
            raise AutoparError(f"--config {config}: no such file")
    elif args.plan:
        from autopar.cli.models import model_from_plan
        from autopar.cli.plan import load_plan

        model = model_from_plan(load_plan(args.plan), args.trust_factory).model
        config = getattr(model, "config", None)
        if not hasattr(config, "save_pretrained"):
            raise AutoparError(
                f"{args.plan}: its model ({type(model).__name__}) is not a transformers model, "
                "so there is no config.json to write; leave out --plan for the weights alone"
            )
    report = export_hf(
        args.checkpoint,
        args.out,
        config,
        dtype=getattr(torch, args.dtype),
        max_shard_bytes=int(args.max_shard_gb * 2**30),
    )
    note = "" if config is not None else " (no config.json: pass --plan or --config)"
    return report.as_text() + note
