"""Context parallelism: the attention of sequence shards equals full attention (forward and
gradients) on 2 and 4 gloo ranks, in every variant (all-gather KV or ring, load-balanced or
contiguous shards, causal or not, a causal sliding window, GQA heads), and the ring and
contiguous variants train gpt-tiny, llama-tiny and a Hugging Face Llama (transformers'
AttentionInterface) as one process does. The trainer's default variant:
test_numerics_cp_ep.py, test_numerics_4ranks.py; models no `parts` entry cuts (their own
forward at the shard's positions): test_any_model.py.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from cp_loop import run_loop_cases
from harness import Case, max_rel_error, reference, run_ranks

from autopar.config import ParallelConfig as C
from autopar.runtime.context_parallel import CPOptions, DirectSDPA, cp_attention, positions

VARIANTS = list(itertools.product(("all_gather", "ring"), ("load_balanced", "contiguous")))
# (kind, layout, causal, sliding window): a window of 5 crosses every shard's edge
ATTENTION_CASES = [(*v, causal, None) for v in VARIANTS for causal in (True, False)] + [
    (*v, True, 5) for v in VARIANTS
]


def test_positions_of_the_load_balanced_layout():
    assert positions(8, 0, 2, "load_balanced").tolist() == [0, 1, 6, 7]
    assert positions(8, 1, 2, "load_balanced").tolist() == [2, 3, 4, 5]
    assert positions(8, 1, 2, "contiguous").tolist() == [4, 5, 6, 7]
    with pytest.raises(ValueError, match="sequence length 6 is not divisible by 4"):
        positions(6, 0, 2, "load_balanced")


def test_a_models_own_sdpa_call_is_redirected_and_a_mask_it_made_refused():
    """`DirectSDPA` hands a model's own causal call of torch's SDPA to context parallelism's
    attention (here a recorder), with the call's scale and heads; a mask that reaches SDPA is
    one the model made itself, which the runtime refuses rather than ignore."""
    calls = []

    def attend(q, k, v, **kwargs):
        calls.append((q.shape, k.shape, kwargs))
        return torch.zeros_like(q)

    q, kv = torch.randn(1, 4, 8, 16), torch.randn(1, 1, 8, 16)
    with DirectSDPA(attend):
        F.scaled_dot_product_attention(q, kv, kv, is_causal=True, scale=0.5)
        with pytest.raises(NotImplementedError, match=r"a mask of shape \(8, 8\) it made"):
            F.scaled_dot_product_attention(q, kv, kv, attn_mask=torch.ones(8, 8, dtype=bool))
    assert calls == [(q.shape, kv.shape, dict(dropout_p=0.0, is_causal=True, scale=0.5,
                                                enable_gqa=True))]  # fmt: skip


def _attention_errors() -> list[tuple[str, float]]:
    """On every rank: each attention case against full SDPA; (label, max abs error)."""
    group, cp, rank = dist.group.WORLD, dist.get_world_size(), dist.get_rank()
    gen = torch.Generator().manual_seed(0)
    b, n, kv_heads, s, d = 2, 4, 2, 8 * cp, 8
    q = torch.randn(b, n, s, d, generator=gen)
    k, v = (torch.randn(b, kv_heads, s, d, generator=gen) for _ in range(2))
    grad_out = torch.randn(b, n, s, d, generator=gen)
    out = []
    for kind, layout, causal, window in ATTENTION_CASES:
        full = [t.clone().requires_grad_() for t in (q, k, v)]
        rep = [t.repeat_interleave(n // kv_heads, dim=1) for t in full[1:]]
        if window is None:
            want = F.scaled_dot_product_attention(full[0], *rep, is_causal=causal)
        else:  # transformers' sliding window: k in (q - window, q]
            i = torch.arange(s)
            mask = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - window)
            want = F.scaled_dot_product_attention(full[0], *rep, attn_mask=mask)
        want.backward(grad_out)
        pos = positions(s, rank, cp, layout)
        local = [t.detach().index_select(2, pos).requires_grad_() for t in (q, k, v)]
        got = cp_attention(*local, group, layout, kind, causal, window=window)
        got.backward(grad_out.index_select(2, pos))
        errors = [(got - want.detach().index_select(2, pos)).abs().max()]
        errors += [
            (mine.grad - ref.grad.index_select(2, pos)).abs().max()
            for mine, ref in zip(local, full, strict=True)
        ]
        label = f"cp{cp} {kind} {layout} causal={causal} window={window}"
        out.append((label, max(e.item() for e in errors)))
    return out


@pytest.mark.multiprocess
@pytest.mark.parametrize("cp", [2, 4])
def test_cp_attention_equals_full_attention_forward_and_backward(cp):
    for per_rank in zip(*run_ranks(cp, _attention_errors), strict=True):
        label = per_rank[0][0]
        worst = max(err for _, err in per_rank)
        assert worst < 1e-5, f"{label}: max abs error {worst:.2e}"


@pytest.mark.multiprocess
def test_cp2_ring_and_contiguous_variants_train_as_one_process():
    """The trainer runs the default (all-gather KV, load-balanced; test_numerics_cp_ep.py);
    the other variants go through the same steps in `cp_ep_loop`."""
    cases = [
        (Case("gpt-tiny", C(cp=2, micro_batch_size=2)), CPOptions(kind="ring")),
        (Case("llama-tiny", C(cp=2)), CPOptions("contiguous", "ring")),
        (Case("llama-tiny-hf", C(cp=2), seq_len=32), CPOptions("contiguous", "all_gather")),
    ]
    got = run_ranks(2, run_loop_cases, cases)
    refs = {}
    for i, (case, options) in enumerate(cases):
        if case.model not in refs:
            refs[case.model] = reference(case)
        err = max(max_rel_error(rank[i], refs[case.model]) for rank in got)
        print(f"{case.label} {options}: max relative error {err:.1e}")
        assert err <= 1e-5, f"{case.label} {options}: {err:.2e}: {got[0][i]} vs {refs[case.model]}"
