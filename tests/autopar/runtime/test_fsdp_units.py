"""The plan and the program cut the same FSDP2 units out of a model's ends.

The runtime makes the token embedding and the LM head units of their own where each is a
layer (its parent holds the blocks) and the two are untied (`data_parallel.end_units`, on the
module tree); the plan prices the same units from the trace (`communication.fsdp_end_units`).
Where they disagreed, a step's all-gathers would differ from the plan's (test_plan_fidelity
counts them on a few models): here both rules run on models of every kind the matrix holds --
untied and tied heads, the embedding nested in an embeddings module (BERT), a position table
beside the token embedding (GPT-2), a model with no vocabulary pair (a classifier).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from harness import Case, task_of

from autopar.estimate.communication import fsdp_end_units
from autopar.estimate.tables import build_tables
from autopar.runtime.data_parallel import end_units
from autopar.runtime.tensor_parallel import find_blocks
from autopar.tracing import trace

CASES = {
    # (case, the units both must find)
    "llama-tiny": (Case("llama-tiny", None), ("embed_tokens", "lm_head")),
    "gpt-tiny (tied)": (Case("gpt-tiny", None), (None, None)),
    "llama-tiny-hf": (Case("llama-tiny-hf", None), ("model.embed_tokens", "lm_head")),
    "gpt2 (tied)": (Case("gpt2", None, factory="model_factories:gpt2"), (None, None)),
    "gpt-neox": (
        Case("gpt-neox", None, factory="model_factories:gpt_neox"),
        ("gpt_neox.embed_in", "lm_head"),
    ),  # fmt: skip
    "bert (nested, tied)": (Case("bert", None, factory="model_factories:bert"), (None, None)),
    "encoder": (
        Case("tiny", None, factory="model_factories:tiny_transformer"),
        ("embed", "head"),
    ),  # fmt: skip
    "vit (no vocabulary)": (
        Case("vit", None, factory="model_factories:vit", data="model_factories:vit_batch"),
        (None, None),
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_plan_and_program_cut_the_same_end_units(name):
    case, want = CASES[name]
    task = task_of(replace(case, seq_len=16))
    model = task.build()
    inputs, _ = task.batch(0, 0, 1)
    tables = build_tables(trace(model, tuple(inputs)))
    assert end_units(model, find_blocks(model)) == want
    assert fsdp_end_units(tables) == want
