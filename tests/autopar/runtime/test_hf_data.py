"""A Hugging Face dataset as the generated program's data, and its blocks under torch.compile
(autopar.runtime.hf_data, `--hf-dataset`, `--compile`, the autopar-compile stack): the token
file holds exactly the tokenizer's ids in document order, is written once, refuses what it
cannot read; a 2-rank FSDP program of an autopar-compile plan trains on the dataset with
compiled blocks to the losses one eager process reaches on the same ids."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import autopar
from autopar.errors import ConfigError
from autopar.models import hf
from autopar.runtime.data import TokenFile, write_tokens
from autopar.runtime.hf_data import hf_token_file
from autopar.runtime.preflight import RunError
from autopar.runtime.task import task_from_source
from autopar.runtime.trainer import TrainOptions, reference_run

datasets = pytest.importorskip("datasets")
REPO = Path(__file__).resolve().parents[3]


def _texts() -> list[str]:  # real prose, ASCII: byte ids below the tiny models' vocabulary
    names = ("docs/architecture.md", "hardware_profiles/README.md")
    return ["".join(c for c in (REPO / n).read_text() if ord(c) < 128) for n in names]


def _saved(tmp_path: Path, columns: dict) -> str:
    path = tmp_path / "dataset"
    datasets.Dataset.from_dict(columns).save_to_disk(str(path))
    return str(path)


def test_bytes_and_a_trained_tokenizer_give_their_ids_in_document_order(tmp_path):
    texts = _texts()
    source = _saved(tmp_path, {"text": texts})
    path, dtype = hf_token_file(source, tokenizer="bytes", cache_dir=tmp_path / "cache")
    want = b"".join(t.encode() + b"\n" for t in texts)  # a newline closes each document
    assert dtype == "uint16" and np.fromfile(path, dtype).tolist() == list(want)
    written = path.stat().st_mtime_ns
    again, _ = hf_token_file(source, tokenizer="bytes", cache_dir=tmp_path / "cache")
    assert again == path and path.stat().st_mtime_ns == written  # cached, not rewritten

    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel()
    bpe.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=300, special_tokens=["</s>"]))
    PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="</s>").save_pretrained(tmp_path / "t")
    path, dtype = hf_token_file(source, tokenizer=str(tmp_path / "t"), cache_dir=tmp_path / "c")
    tok = AutoTokenizer.from_pretrained(tmp_path / "t")
    want = [i for t in texts for i in (*tok(t)["input_ids"], tok.eos_token_id)]
    assert np.fromfile(path, dtype).tolist() == want and len(want) < sum(map(len, texts))


def test_id_columns_and_data_files_read_without_a_tokenizer(tmp_path):
    rows = [[5, 6, 7], [8, 9]]
    path, dtype = hf_token_file(_saved(tmp_path, {"ids": rows}), column="ids", cache_dir=tmp_path)
    assert np.fromfile(path, dtype).tolist() == [5, 6, 7, 8, 9] and dtype == "uint32"
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text("".join(json.dumps({"text": t}) + "\n" for t in ("ab", "c")))
    path, dtype = hf_token_file(str(jsonl), tokenizer="bytes", cache_dir=tmp_path)
    assert np.fromfile(path, dtype).tolist() == [97, 98, 10, 99, 10]


def test_what_it_cannot_read_is_refused_by_name(tmp_path):
    source = _saved(tmp_path, {"text": ["a b"]})
    with pytest.raises(ValueError, match="has no column 'body': its columns are text"):
        hf_token_file(source, column="body", cache_dir=tmp_path)
    with pytest.raises(ValueError, match="holds text: name a tokenizer"):
        hf_token_file(source, cache_dir=tmp_path)
    odd = tmp_path / "notes.docx"
    odd.write_text("x")
    with pytest.raises(ValueError, match="not a data file datasets reads by extension"):
        hf_token_file(str(odd), tokenizer="bytes", cache_dir=tmp_path)


def test_what_datasets_and_transformers_raise_becomes_one_line_naming_the_option(
    tmp_path, monkeypatch
):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # this machine reaches no Hub: say so at once
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"text": "fine"}\n{"text": no quotes}\n')
    good = tmp_path / "good.jsonl"
    good.write_text('{"text": "fine"}\n')
    (tmp_path / "empty-tokenizer").mkdir()
    splits = tmp_path / "splits"
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": ["a"]})}).save_to_disk(
        str(splits)
    )
    cases = [
        ((str(broken), "train", "bytes"), f"--hf-dataset {broken}: cannot be read"),
        (("nobody/no-such-dataset", "train", "bytes"), "--hf-dataset nobody/no-such-dataset"),
        ((str(good), "train", str(tmp_path / "empty-tokenizer")), "--tokenizer "),
        ((str(good), "validation", "bytes"), "is one data file, read as the split 'train'"),
        ((str(splits), "test", "bytes"), "--hf-split 'test': "),
    ]
    for (source, split, tok), fragment in cases:
        with pytest.raises(RunError) as caught:
            hf_token_file(source, split=split, tokenizer=tok, cache_dir=tmp_path / "cache")
        said = str(caught.value)
        assert fragment in said and "\n" not in said and len(said) < 700, said
    assert "holds the splits train" in said


def _plan(config: autopar.ParallelConfig, stack: str):
    import torch

    return autopar.evaluate(
        hf.build("llama-tiny-hf"),
        autopar.Cluster.from_profile("local_cpu", 1, num_devices=2),
        config,
        (torch.randint(0, 128, (1, 64), device="meta"),),
        global_batch_size=4,
        precision="fp32",
        stack=stack,
        model_factory=("autopar.models.hf:build", {"name": "llama-tiny-hf"}),
    )


def test_the_compiled_stack_refuses_tensor_parallel_plans():
    with pytest.raises(ConfigError, match="tp=2 cp=1 ep=1 on the autopar-compile stack"):
        _plan(autopar.ParallelConfig(tp=2), "autopar-compile")


def _torchrun(train: Path, cache: Path, *args: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    env["AUTOPAR_CACHE"] = str(cache)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--standalone"]
    done = subprocess.run(
        [*cmd, str(train), "--steps", "3", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=500,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.mark.slow
@pytest.mark.multiprocess
def test_compiled_program_trains_on_a_dataset_as_one_eager_process_on_its_ids(tmp_path):
    config = autopar.ParallelConfig(fsdp=2, zero_stage=3, micro_batch_size=2, recompute="full")
    plan = _plan(config, "autopar-compile")
    assert plan.stack == "autopar-compile"
    plan.save(tmp_path / "run")
    texts = _texts()
    source = _saved(tmp_path, {"text": texts})
    compiled = _torchrun(
        tmp_path / "run" / "train.py", tmp_path / "cache", "--hf-dataset", source,
        "--tokenizer", "bytes", "--metrics", str(tmp_path / "compiled.jsonl"),
    )  # fmt: skip
    assert "torch.compile: each of the 2 blocks" in compiled  # on: the plan's stack compiles
    got = [json.loads(x)["loss"] for x in (tmp_path / "compiled.jsonl").read_text().splitlines()]
    # the reference: one eager process on the same ids, written as a plain token file
    ids = write_tokens(tmp_path / "ids.bin", list(b"".join(t.encode() + b"\n" for t in texts)))
    task = task_from_source(
        "autopar.models.hf:build", {"name": "llama-tiny-hf"}, global_batch_size=4,
        seq_len=plan.seq_len, data=TokenFile(ids, plan.seq_len, 4),
    )  # fmt: skip
    want = [r.loss for r in reference_run(task, 4, TrainOptions(steps=3, log=False))]
    assert len(got) == 3
    assert got == pytest.approx(want, rel=1e-5)  # inductor's fused kernels, same arithmetic


def _refusal_on_every_rank(source: str, cache: str) -> str:
    from autopar.runtime.hf_data import node_token_file

    try:
        node_token_file(source, column="body", tokenizer="bytes", cache_dir=cache)
    except ValueError as e:
        return str(e)
    return "no error"


@pytest.mark.multiprocess
def test_a_refusal_on_the_writing_rank_reaches_every_rank_without_a_hang(tmp_path):
    from harness import run_ranks

    source = _saved(tmp_path, {"text": ["a b"]})
    said = run_ranks(2, _refusal_on_every_rank, source, str(tmp_path / "cache"))
    assert all("has no column 'body'" in s for s in said), said
