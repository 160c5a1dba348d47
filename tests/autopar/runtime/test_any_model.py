"""Any model the tracer takes runs under what autopar plans for it, or is refused (issue 19).

Models, each from the user's own factory (`model_factories`, not autopar's builders): a
from-scratch transformer on nn.MultiheadAttention, an MLP classifier with its own loss, and
Hugging Face GPT-2, GPT-NeoX, Gemma 2, Phi-3, Qwen2, BERT (masked LM), T5 (encoder-decoder)
and ViT (image classification), built from configs; and issue 47's thirteen more families
(`family_factories`: OLMo2, Gemma 3, Falcon, StableLM, Granite, GraniteMoE, OLMoE, Qwen3 with
tied embeddings, Llama 4, Cohere, Mamba2, SmolLM3, an encoder with its own loss) and three
that a trial of 26 more found mis-split (OPT, ModernBERT, MPT) under TP, TP+SP and CP.

Styles, on 2 and 4 local_cpu devices: the plan `parallelize` returns, and forced DP, FSDP
(ZeRO-3), TP, TP+SP, PP and CP (the suite runs on 2 ranks all but DP, the forced twins of the
plans and FSDP of the Llama-like blocks, on 4 two pipelines and GPT-2 and Phi-3's fused
projections under PP x TP + SP and FSDP x TP; the script below, all styles on both).
Each either prices (`evaluate`) and then trains 3 steps on gloo ranks to the single
process's loss and gradient norm within 1e-5 relative (fp32), or is refused at `evaluate`
with a message naming the model and the part; which ones are refused is pinned below.

    python3 tests/autopar/runtime/test_any_model.py [model ...]   # the matrix, model x style
    python3 tests/autopar/runtime/test_any_model.py --alternatives  # each plan's alternatives
    python3 tests/autopar/runtime/test_any_model.py --more   # 23 families more (`more_families`)
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from harness import Case, check_cases

import autopar
from autopar.config import ParallelConfig as C
from autopar.config.text import parse_config
from autopar.errors import ConfigError
from autopar.runtime.task import task_from_source

GLOBAL_BATCH, SEQ = 8, 16

# label -> (factory, data hook, loss) in model_factories; None: token ids / next-token loss
MODELS = {
    "mha": ("tiny_transformer", None, None),
    "classifier": ("classifier", "classifier_batch", "classify_loss"),
    "gpt2": ("gpt2", None, None),
    "gpt-neox": ("gpt_neox", None, None),
    "gemma2": ("gemma2", None, None),
    "phi3": ("phi3", None, None),
    "qwen2": ("qwen2", None, None),
    "bert": ("bert", None, "masked_lm_loss"),
    "t5": ("t5", "t5_batch", "masked_lm_loss"),
    "vit": ("vit", "vit_batch", "classify_loss"),
}
# issue 47's thirteen families no test named before, and three more (`family_factories`)
FAMILIES = {
    **{m: (f"family_factories:{m}", None, None)
       for m in ("olmo2", "gemma3", "falcon", "stablelm", "granite", "granite_moe", "olmoe",
                 "qwen3_tied", "llama4", "cohere", "mamba2", "smollm3", "opt", "modernbert",
                 "mpt")},
    "encoder": tuple(f"family_factories:encoder{s}" for s in ("", "_batch", "_loss")),
}  # fmt: skip


# families the script tries (`--more`) and the suite does not (`more_families`)
MORE = {
    m: (f"more_families:{m}", None, None)
    for m in ("mistral", "mixtral", "phi", "gemma", "gptj", "bloom", "starcoder2", "qwen2_moe",
              "nemotron", "glm4", "gpt_bigcode", "gpt_neo", "persimmon", "deepseek_v2",
              "gpt_oss", "olmo3", "exaone4", "ernie4_5", "helium", "arcee", "dbrx", "codegen",
              "lfm2")
}  # fmt: skip


def styles(n: int) -> dict[str, C]:
    half = n // 2
    return {
        "DP": C(dp=n),
        "FSDP": C(fsdp=n, zero_stage=3),
        "TP": C(tp=2, dp=half),
        "TP+SP": C(tp=2, dp=half, sequence_parallel=True),
        "PP": C(pp=2, dp=half),
        "CP": C(cp=2, dp=half),
        "CP ring": C(cp=2, dp=half, cp_attention="ring"),
    }


# (model, style) refused at evaluate on 2 and 4 devices, and the words that say why. GPT-NeoX's
# and BERT's projections, outside the Megatron names, split as the trace pairs them (ViT's MLP
# too); GPT-2's fused c_attn (a Conv1D) and Phi-3's fused qkv_proj and gate_up_proj split piece
# by piece where their code cuts them (`autopar.runtime.fused_pieces`); T5 views heads by a fixed
# count (`autopar.runtime.split_check`) and nn.MultiheadAttention holds its weights outside a
# linear layer
_NO_TP = "blocks replicated"
# a model with no Hugging Face config nor parts entry: its own attention calls, named
_BOTH_WAYS = "layers.0.self_attn calls torch's scaled_dot_product_attention with no mask and "
_NO_PP = "cannot cut"
_OWN_CODE = "multiplies by its weights in its own code"
_FAILS = "its code fails with"
REFUSED = {
    **{(m, s): why for m, why in (("mha", _OWN_CODE), ("classifier", _NO_TP), ("t5", _FAILS))
       for s in ("TP", "TP+SP")},
    ("mha", "CP"): _BOTH_WAYS,
    ("classifier", "CP"): "Classifier calls no scaled dot-product attention",
    ("bert", "CP"): "bert.encoder.layer.0.attention.self attends under a mask that is neither",
    ("t5", "CP"): "Seq2Seq has no set_attn_implementation",
    ("vit", "CP"): "ViTForImageClassification.forward takes no position_ids",
    ("gemma2", "CP"): "soft-caps its attention scores",
    ("classifier", "PP"): _NO_PP,
    ("t5", "PP"): _NO_PP,
    ("vit", "TP+SP"): "the blocks' sequence of 17 does not divide",
}  # fmt: skip


# (family, style) of `FAMILIES` refused at evaluate on 2 devices, and the words that say why:
# each names the module and what its code does
_HEADS_NORM = "normalises the whole output of a column-parallel projection"
FAMILY_REFUSED = {
    **{(m, s): why for m, why in (
        ("olmo2", _HEADS_NORM),
        ("olmoe", _HEADS_NORM),
        ("falcon", "its code fails with transformer.h.0.self_attention.query_key_value"),
        ("stablelm", "its code fails with model.layers.0.self_attn.q_proj"),
        ("cohere", "its code fails with model.layers.0.self_attn.q_proj"),
        ("llama4", "changes model.layers.1.feed_forward.shared_expert.down_proj's output in "
                   "place (add_)"),
        ("mamba2", "cuts backbone.layers.0.mixer.in_proj's output into pieces of [64, 80, 8]"),
        ("opt", "reshapes model.decoder.layers.0.self_attn.q_proj's output (view) to "
                "[1, 8, 4, 8] on a tp rank, where that rank's share of the whole [1, 16, 4, 8] "
                "is [1, 16, 2, 8]"),
        ("mpt", "would leave transformer.blocks.0.attn.Wqkv (Linear) whole, in "
                "MptForCausalLM's blocks that it splits otherwise"),
        ("encoder", "layers.0.self_attn (MultiheadAttention) multiplies by its weights"),
    ) for s in ("TP", "TP+SP")},
    ("falcon", "PP"): "its code makes transformer.h.0.self_attention.lifted_tensor_0 and 7 more "
                      "from the meta device's tensors",
    ("llama4", "CP"): "model.layers.0.self_attn attends under a mask made from the run's own",
    ("mamba2", "CP"): "Mamba2ForCausalLM.forward takes no position_ids",
    ("encoder", "CP"): _BOTH_WAYS,
    ("modernbert", "CP"): "model.layers.0.attn attends under a mask that is neither",
    ("mpt", "CP"): "MptForCausalLM.forward takes no position_ids",
}  # fmt: skip


def _source(label: str) -> dict[str, str | None]:
    names = MODELS.get(label) or FAMILIES.get(label) or MORE[label]
    factory, data, loss = (n and (n if ":" in n else f"model_factories:{n}") for n in names)
    return {"factory": factory, "data": data, "loss": loss}


def matrix(
    n: int, labels: list[str] | None = None, only: tuple[str, ...] | None = None
) -> tuple[list[Case], dict[tuple, str]]:
    """The cases that price on ``n`` devices (to run) and the refusals {(model, style): why};
    ``only``: these styles ("auto" and names of `styles`), default all."""
    cases, refused = [], {}
    cluster = autopar.Cluster.from_profile("local_cpu", 1, num_devices=n)
    options = autopar.PlanOptions(sensitivity=False)
    for label in labels or list(MODELS):
        model, inputs = _model_and_inputs(label)
        graph = autopar.trace(model, inputs)  # once per model: each style prices the same
        planned = {}
        if only is None or "auto" in only:
            plan = autopar.parallelize(model, cluster, graph=graph, options=options, **_COMMON)
            planned["auto"] = (plan.config, plan)
        for style, config in styles(n).items():
            if only is not None and style not in only:
                continue
            config = C(**{**config.__dict__, "micro_batch_size": 1})
            try:
                planned[style] = (
                    config,
                    autopar.evaluate(model, cluster, config, graph=graph, **_COMMON),
                )
            except ConfigError as e:
                refused[(label, style)] = str(e)
        cases += [_case(label, style, priced) for style, (_, priced) in planned.items()]
    return cases, refused


_COMMON = dict(global_batch_size=GLOBAL_BATCH, precision="fp32")


def _model_and_inputs(label: str) -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
    source = _source(label)
    task = task_from_source(
        source["factory"], {}, global_batch_size=GLOBAL_BATCH, seq_len=SEQ,
        data=source["data"], loss=source["loss"],
    )  # fmt: skip
    # planning traces the model on the meta device: no weights made
    return task.build_meta(), tuple(t[:1].to("meta") for t in task.batch(0, 0, 1)[0])


def _case(label: str, style: str, priced: autopar.Plan) -> Case:
    config = priced.config
    stages = tuple(tuple(s.layers) for s in priced.stages) if config.pp > 1 else None
    params = tuple(s.memory_bytes["parameters"] for s in priced.stages)
    return Case(f"{label} [{style}]", config, GLOBAL_BATCH, placements=priced.placements,
                stage_layers=stages, seq_len=SEQ, roles=priced.tensor_parallel_roles,
                planned_params=params, **_source(label))  # fmt: skip


def composed(n: int, label: str, config: C) -> Case:
    """A case of ``label`` under ``config`` on ``n`` devices, as `evaluate` prices it."""
    model, inputs = _model_and_inputs(label)
    cluster = autopar.Cluster.from_profile("local_cpu", 1, num_devices=n)
    priced = autopar.evaluate(model, cluster, config, inputs, **_COMMON)
    return _case(label, config.as_text().split(" |")[0], priced)


def _without_plan_twins(cases: list[Case]) -> list[Case]:
    """``cases`` less each forced style whose degrees equal its model's plan's."""

    def degrees(case: Case) -> tuple:
        c = case.config
        return (c.dp, c.fsdp, c.cp, c.tp, c.pp, c.sequence_parallel)

    planned = {c.model.split(" [")[0]: degrees(c) for c in cases if c.model.endswith("[auto]")}
    return [
        c for c in cases
        if c.model.endswith("[auto]") or degrees(c) != planned.get(c.model.split(" [")[0])
    ]  # fmt: skip


def _check_refusals(refused: dict[tuple, str], want: dict[tuple, str]) -> None:
    """``refused`` is exactly ``want``'s cells, each saying ``want``'s words."""
    assert set(refused) == set(want), (
        sorted(set(refused) - set(want)),
        sorted(set(want) - set(refused)),
    )
    for key, why in refused.items():
        assert want[key] in why, (key, why)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_every_model_runs_what_is_planned_for_it_or_is_refused_on_2_ranks():
    """Every style but forced DP, which touches no module of the model (the plans of the
    classifier and T5 are DP), and a forced style with the degrees of the model's plan (a
    pipeline of two stages for most: the plan's schedule runs, the forced 1F1B is the
    script's)."""
    # the ring: on the families' CP test below
    cases, refused = matrix(2, only=("auto", *(s for s in styles(2) if s not in ("DP", "CP ring"))))
    _check_refusals(refused, REFUSED)
    cases = [c for c in _without_plan_twins(cases) if not _fsdp_like_llama(c)]
    check_cases(2, cases)


def _fsdp_like_llama(case: Case) -> bool:
    """Forced FSDP of a model whose blocks are nn.Linear blocks in one list, as Llama's (the
    FSDP units of test_hf_llama.py and test_numerics_transformers.py); the suite keeps the
    ones whose units differ: no blocks (classifier), Conv1D blocks (GPT-2, root unit only),
    two lists (T5), packed attention (mha), an encoder of patches (ViT)."""
    like = ("gpt-neox", "gemma2", "phi3", "qwen2", "bert")
    return case.model.endswith("[FSDP]") and case.model.split(" [")[0] in like


@pytest.mark.multiprocess
@pytest.mark.slow
def test_every_model_runs_its_plan_and_a_pipeline_over_data_parallelism_on_4_ranks():
    """What 4 ranks add to 2: pipelines of 4 stages -- Gemma 2's plan, cut by its parts (each
    layer's mask by its attention type, the tied head summed across four), and BERT's cut from
    its traced graph (its attention mask carried through the middle stages) -- and pp x dp
    (BERT); the other styles and models differ from 2 ranks only in their degree (the script
    runs them all); and fused projections split piece by piece under two dimensions more:
    GPT-2's c_attn over a pipeline with SP (each chunk's plan carrying the pieces), Phi-3's
    qkv_proj and gate_up_proj under FSDP2 (which shards the tp rank's pieces again, on the
    same dimension)."""
    cases, _ = matrix(4, ["gemma2"], only=("auto",))
    more, _ = matrix(4, ["bert"], only=("PP",))
    more.append(composed(4, "bert", C(pp=4, micro_batch_size=1)))
    assert [c.config.pp for c in cases + more] == [4, 2, 4], [c.label for c in cases + more]
    fused = [
        composed(4, "gpt2", C(pp=2, tp=2, sequence_parallel=True, micro_batch_size=1)),
        composed(4, "phi3", C(fsdp=2, tp=2, zero_stage=3, micro_batch_size=1)),
    ]
    assert all("/" in style for c in fused for style in c.roles.values()), fused
    check_cases(4, cases + more + fused)


def test_more_families_are_planned_or_refused_naming_the_module_and_the_operation():
    """Issue 47's thirteen families and three more under TP, TP+SP, CP and PP on 2 devices:
    what `evaluate` refuses is pinned (above), and what it accepts runs: gemma3, granite,
    granite_moe, qwen3_tied and smollm3 under every style; olmo2, stablelm, olmoe, cohere,
    falcon and opt under CP, through their own forward; modernbert under TP with its Wqkv
    split piece by piece; all but Falcon under a pipeline cut from the traced graph (the
    script below runs them all on ranks)."""
    refused = {}
    for label in FAMILIES:
        refused.update(matrix(2, [label], only=("TP", "TP+SP", "CP", "PP"))[1])
    _check_refusals(refused, FAMILY_REFUSED)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_context_parallelism_runs_models_through_their_own_forward_on_2_ranks():
    """No `parts` entry cuts these: each runs its own forward at the shard's positions, its
    attention replaced through transformers' interface -- Gemma 3's sliding layers (a window
    of 8 in 16 tokens, across the shards' edges) and full ones, OLMoE's experts split over
    the cp ranks too (ep=2 folded over cp: each rank's sequence shard dispatched to both
    ranks' experts), Cohere's [heads, head_dim] q/k norm, Falcon's own calls of torch's SDPA
    (redirected, round the ring, and again where full recompute re-runs its blocks in
    backward) -- and GraniteMoE's blocks split under TP + SP, and ModernBERT's: its Wqkv,
    viewed as (3, heads, head_dim), split piece by piece."""
    cases = [composed(2, m, C(cp=2, micro_batch_size=1)) for m in ("gemma3", "cohere")]
    ring = C(cp=2, cp_attention="ring", recompute="full", micro_batch_size=1)
    cases.append(composed(2, "falcon", ring))
    cases.append(composed(2, "olmoe", C(cp=2, ep=2, micro_batch_size=1)))
    for m in ("granite_moe", "modernbert"):
        cases.append(composed(2, m, C(tp=2, sequence_parallel=True, micro_batch_size=1)))
    assert cases[-1].roles["model.layers.0.attn.Wqkv"] == "col/3", cases[-1].roles
    check_cases(2, cases)


def alternatives(n: int, label: str) -> list[Case]:
    """``label``'s plan on ``n`` devices and every alternative it lists, each priced by
    `evaluate` (which must accept it: the search offers nothing the runtime refuses)."""
    model, inputs = _model_and_inputs(label)
    cluster = autopar.Cluster.from_profile("local_cpu", 1, num_devices=n)
    graph = autopar.trace(model, inputs)
    options = autopar.PlanOptions(sensitivity=False)
    plan = autopar.parallelize(model, cluster, graph=graph, options=options, **_COMMON)
    cases = [_case(label, "auto", plan)]
    for i, alternative in enumerate(plan.alternatives):
        config = parse_config(alternative["config"])
        priced = autopar.evaluate(model, cluster, config, graph=graph, **_COMMON)
        cases.append(_case(label, f"alternative {i + 1}", priced))
    return cases


@pytest.mark.multiprocess
@pytest.mark.slow
def test_every_alternative_a_plan_lists_runs_on_2_ranks():
    """Issue 47's property on two families no `parts` entry cuts: the plan (a pipeline cut
    from the traced graph, zero-bubble) and each alternative `parallelize` lists (DP, FSDP,
    TP over Gemma 3's sliding and full layers) train 3 steps to one process's losses. The
    script below checks every model's (`--alternatives`)."""
    cases = [c for label in ("gemma3", "cohere") for c in alternatives(2, label)]
    assert len(cases) >= 4, [c.label for c in cases]
    check_cases(2, cases)


def _main(labels: list[str], listed: bool = False) -> None:
    """Print the matrix: each model alone on 2 and 4 ranks, failures reported, not raised
    (a stage's parameter bytes other than its plan's too: "PARAMETER BYTES" lines);
    ``listed``: each model's plan and the alternatives it lists instead of the styles."""
    for n in (2, 4):
        for label in labels:
            try:  # a model the tracer refuses (DBRX's data-dependent experts) is one line
                cases, refused = (alternatives(n, label), {}) if listed else matrix(n, [label])
            except autopar.AutoparError as e:
                print(f"{n} ranks  {label:10s} not planned: {str(e)[:300]}")
                continue
            for (_, style), why in refused.items():
                print(f"{n} ranks  {label:10s} {style:6s} refused: {why.split(': ', 1)[1]}")
            try:
                errors = check_cases(n, cases, report=True)
            except Exception as e:  # one failing case fails the model's spawn
                print(f"{n} ranks  {label:10s} FAILED: {type(e).__name__}: {str(e)[-600:]}")
                continue
            for case in cases:
                print(f"{n} ranks  {case.model:20s} {case.config.as_text()}  "
                      f"ran, max rel error {errors[case.label]:.1e}")  # fmt: skip


if __name__ == "__main__":
    torch.set_num_threads(1)
    sys.path.insert(0, str(Path(__file__).parent))
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    default = [*MORE] if "--more" in sys.argv else [*MODELS, *FAMILIES]
    _main(args or default, listed="--alternatives" in sys.argv)
