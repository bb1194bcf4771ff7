"""Real data without glue code (issue 27, item 5): ``train.py --data PATH`` on a dataset file
(JSON Lines, JSON, Parquet, Arrow, a ``save_to_disk`` directory) read with Hugging Face
``datasets`` and tokenized with a local ``--tokenizer``: packed into rows of the pipeline's
sequence length (documents separated by the end-of-sequence token, ``position_ids`` restarting at
each document) or, for a ``--dynamic`` sequence, batched by length; a step's batch a function of
the step alone, so that a run resumed mid-epoch trains as an uninterrupted one; clear errors for
what cannot be read. The corpus and tokenizer are examples/data's, made locally.

The logic is checked in-process on the packages' own ``Batches``; one pair of torchrun runs
trains, checkpoints and resumes."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import datasets
import pytest
import torch
from transformers import AutoTokenizer

from autopipe.runtime.core.errors import PipelineRunError
from autopipe.runtime.core.pipeline import Pipeline
from autopipe.runtime.corpus import (
    GROUP_STEPS,
    Documents,
    documents_from_ids,
    is_corpus,
    length_batches,
    packed,
    pieces,
    restarting_positions,
    row_format,
    rows_of_step,
)
from autopipe.runtime.data import Batches
from autopipe.runtime.options import parse_config
from autopipe.verify import load_pipeline

from conftest import ROOT, compile_model, run_ranks

sys.path.insert(0, str(ROOT / "examples" / "data"))
import make_corpus  # noqa: E402 - examples/data/make_corpus.py, the corpus's recipe

DATA = ROOT / "examples" / "data"
CORPUS, TOKENIZER = DATA / "corpus.jsonl", DATA / "tokenizer"
MODEL = "examples/data/model.py:build"
SEQ_BOUNDS = "seq[8:128]=input_ids:1,position_ids:1,attention_mask:1,labels:1"
#: a step's rows: 4 microbatches of the example's 2 samples
MICROBATCHES, ROWS, EOS, PAD = 4, 8, 1, 2

datasets.disable_progress_bars()


@pytest.fixture(scope="module")
def static(tmp_path_factory) -> Path:
    """examples/data/model.py in 2 stages: packed rows of 32 tokens."""
    out = tmp_path_factory.mktemp("corpus") / "static"
    compile_model(MODEL, out, 2)
    return out


@pytest.fixture(scope="module")
def dynamic(tmp_path_factory) -> Path:
    """The same model with a dynamic sequence of 8 to 128 tokens: batched by length."""
    out = tmp_path_factory.mktemp("corpus") / "dynamic"
    compile_model(MODEL, out, 2, dynamic=[SEQ_BOUNDS])
    return out


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(str(TOKENIZER), local_files_only=True)


@pytest.fixture(scope="module")
def texts() -> list[str]:
    return [json.loads(line)["text"] for line in CORPUS.read_text().splitlines()]


@pytest.fixture(scope="module")
def forms(tmp_path_factory) -> dict[str, Path]:
    """The corpus in every form a dataset file takes."""
    folder = tmp_path_factory.mktemp("forms")
    dataset = datasets.load_dataset("json", data_files=str(CORPUS), split="train")
    dataset.to_parquet(str(folder / "corpus.parquet"))
    dataset.save_to_disk(str(folder / "saved"))
    (folder / "corpus.json").write_text(json.dumps(dataset.to_list()))  # a JSON array
    shutil.copy(next((folder / "saved").glob("*.arrow")), folder / "corpus.arrow")
    return {
        "jsonl": CORPUS,
        "json": folder / "corpus.json",
        "parquet": folder / "corpus.parquet",
        "arrow": folder / "corpus.arrow",
        "save_to_disk": folder / "saved",
    }


def pipeline_of(package: Path) -> Pipeline:
    return Pipeline.from_json(load_pipeline(package).PIPELINE)


def batches(package: Path, *argv: str, held_out: bool = False) -> Batches:
    pipeline = pipeline_of(package)
    config = parse_config(["--microbatches", str(MICROBATCHES), *argv], pipeline)
    return Batches(pipeline, config, held_out=held_out)


def corpus_batches(package: Path, data: Path | str = CORPUS, *argv: str) -> Batches:
    return batches(package, "--data", str(data), "--tokenizer", str(TOKENIZER), *argv)


def named(batch, package: Path) -> dict[str, torch.Tensor]:
    inputs, target = batch
    assert target is None
    return {v.name: t for v, t in zip(pipeline_of(package).data_inputs, inputs)}


def stream(tokenizer, texts: list[str]) -> list[int]:
    """The documents tokenized one after another, each followed by <eos>."""
    return [t for text in texts for t in [*tokenizer(text)["input_ids"], EOS]]


# -- the corpus ------------------------------------------------------------------------------
def test_the_shipped_corpus_and_tokenizer_are_what_the_script_makes(tmp_path, tokenizer):
    make_corpus.main(tmp_path)
    assert (tmp_path / "corpus.jsonl").read_bytes() == CORPUS.read_bytes()
    shipped = sorted(p.name for p in TOKENIZER.iterdir())
    assert sorted(p.name for p in (tmp_path / "tokenizer").iterdir()) == shipped
    for name in shipped:
        assert (tmp_path / "tokenizer" / name).read_bytes() == (TOKENIZER / name).read_bytes()
    assert CORPUS.stat().st_size < 200_000 and len(CORPUS.read_text().splitlines()) >= 200
    assert len(tokenizer) == 96  # fits the model's embedding of 96 rows
    assert (tokenizer.eos_token_id, tokenizer.pad_token_id) == (EOS, PAD)


def test_dataset_files_are_told_from_functions(forms):
    assert all(is_corpus(str(path)) for path in forms.values())
    assert not is_corpus("tests/models.py:gpt2_batch") and not is_corpus("pkg.mod:batches")


# -- packed rows -----------------------------------------------------------------------------
def test_documents_are_followed_by_eos_once_and_empty_ones_left_out():
    documents = documents_from_ids([[5, 6], [], [7, 1], [8]], eos=1)
    assert documents.tokens.tolist() == [5, 6, 1, 7, 1, 8, 1]
    assert documents.starts.tolist() == [0, 3, 5, 7] and documents.count == 3
    assert documents_from_ids([[5, 6], [7]], eos=None).tokens.tolist() == [5, 6, 7]


def test_position_ids_restart_at_each_document_start():
    documents = documents_from_ids([[10] * 2, [11] * 4, [12] * 1, [13] * 6], eos=1)
    rows = packed(documents, 4)  # 3 + 5 + 2 + 7 = 17 tokens: 4 rows, one token left out
    assert rows.tokens.shape == (4, 4)
    assert rows.tokens.flatten().tolist() == documents.tokens[:16].tolist()
    assert restarting_positions(rows.begins).tolist() == [
        [0, 1, 2, 0],  # document 0 (with its <eos>), document 1 begins
        [0, 1, 2, 3],  # document 1 goes on: counted from the row's start
        [0, 1, 0, 1],  # document 2, document 3
        [0, 1, 2, 3],
    ]


def test_packed_batches_are_the_documents_with_eos_between(static, tokenizer, texts):
    """Every row of a step's batch is a window of the tokenized documents one after another
    (<eos> after each), at a multiple of the sequence length; labels are the ids, the mask all
    ones, positions restart after each <eos>."""
    tokens = torch.tensor(stream(tokenizer, texts))
    length = 32
    windows = tokens[: len(tokens) // length * length].view(-1, length)
    batch = named(corpus_batches(static)(3), static)
    ids = batch["input_ids"]
    assert ids.shape == (ROWS, length) and ids.dtype == torch.int64
    for row in ids:
        assert (windows == row).all(dim=1).any(), "a row is not a window of the documents"
    assert torch.equal(batch["labels"], ids) and bool((batch["attention_mask"] == 1).all())
    positions = batch["position_ids"]
    assert bool((positions[:, 0] == 0).all())
    after_eos = ids[:, :-1] == EOS
    expected = torch.where(after_eos, 0, positions[:, :-1] + 1)
    assert torch.equal(positions[:, 1:], expected) and bool(after_eos.any())


def test_a_steps_batch_depends_only_on_the_step(static):
    """What a resumed run relies on: step N's batch, read first or after other steps, is the
    same; the epochs go on past the corpus's end, each a new order of every row."""
    first = corpus_batches(static)
    for step in range(5):
        first(step)
    again = corpus_batches(static)
    assert all(torch.equal(a, b) for a, b in zip(first(4)[0], again(4)[0]))
    assert not torch.equal(first(4)[0][0], corpus_batches(static, CORPUS, "--seed", "1")(4)[0][0])
    total, count = 20, 8  # rows, and rows a step: an epoch is 2.5 steps
    steps = [rows_of_step(step, count, total, seed=0, shuffle=True) for step in range(5)]
    order = torch.cat(steps)
    assert sorted(order[:total].tolist()) == list(range(total)) == sorted(order[total:].tolist())
    assert not torch.equal(order[:total], order[total:])  # the second epoch reshuffled
    assert torch.equal(rows_of_step(3, count, total, 0, True), steps[3])
    assert rows_of_step(1, 4, 6, 0, shuffle=False).tolist() == [4, 5, 0, 1]  # held out: in order


def test_every_form_reads_the_same_rows(static, forms):
    expected = corpus_batches(static)(2)[0]
    for form, path in forms.items():
        got = corpus_batches(static, path)(2)[0]
        assert all(torch.equal(a, b) for a, b in zip(got, expected)), form


def test_a_dataset_dict_gives_train_to_data_and_validation_to_eval_data(static, tmp_path, capsys):
    """Evaluation reads the split 'validation' (or 'test'), and says which; a DatasetDict
    without one is refused, naming its splits and --eval-split, which chooses another (issue
    41: it evaluated the training split without a word)."""
    train = datasets.Dataset.from_dict({"text": ["the heron went out. " * 20] * 20})
    validation = datasets.Dataset.from_dict({"text": ["sea calm. " * 20] * 20})
    datasets.DatasetDict({"train": train, "validation": validation}).save_to_disk(tmp_path / "d")
    argv = ["--eval-data", str(tmp_path / "d"), "--tokenizer", str(TOKENIZER)]
    data = batches(static, "--data", str(tmp_path / "d"), *argv)(0)[0][0]
    held_out = batches(static, "--data", str(tmp_path / "d"), *argv, held_out=True)(0)[0][0]
    assert set(data.unique().tolist()) != set(held_out.unique().tolist())
    assert f"--eval-data {tmp_path / 'd'} (its split 'validation'): 20 documents" in (
        capsys.readouterr().out
    )

    datasets.DatasetDict({"train": train}).save_to_disk(tmp_path / "t")
    argv = ["--eval-data", str(tmp_path / "t"), "--tokenizer", str(TOKENIZER)]
    assert refused(batches(static, *argv, held_out=True)) == (
        f"--eval-data {tmp_path / 't'}: evaluation reads the split 'validation' (or 'test') of a "
        "DatasetDict, and this one has the splits 'train': choose the held-out one with "
        "--eval-split SPLIT"
    )
    chosen = batches(static, *argv, "--eval-split", "train", held_out=True)(0)[0][0]
    assert set(chosen.unique().tolist()) == set(data.unique().tolist())  # the training text
    missing = batches(static, *argv, "--eval-split", "test", held_out=True)
    assert "--eval-split test: the DatasetDict has no such split; its splits are 'train'" in (
        refused(missing)
    )


def test_held_out_batches_beyond_the_data_say_so(static):
    read = batches(static, "--eval-data", str(CORPUS), "--tokenizer", str(TOKENIZER), held_out=True)
    read.prepare()
    epoch = read.corpus.batches_per_epoch
    assert read.coverage(epoch) is None
    assert read.coverage(epoch + 2) == (
        f"--eval-data {CORPUS}: it gives {epoch} held-out batches, and --eval-batches "
        f"{epoch + 2} reads 2 of them again (the held-out loss counts them twice or more); give "
        f"--eval-batches {epoch} to read each once"
    )


def test_documents_already_tokenized_need_no_tokenizer(static, tmp_path, tokenizer, texts):
    path = tmp_path / "ids.jsonl"
    ids = [[*tokenizer(text)["input_ids"], EOS] for text in texts]
    path.write_text("".join(json.dumps({"input_ids": row}) + "\n" for row in ids))
    got = batches(static, "--data", str(path))(1)[0]
    assert all(torch.equal(a, b) for a, b in zip(got, corpus_batches(static)(1)[0]))


# -- batched by length -----------------------------------------------------------------------
def test_long_documents_are_cut_into_pieces():
    documents = Documents(torch.arange(12), torch.tensor([0, 3, 12]))
    cut = pieces(documents, 4)
    assert cut.starts.tolist() == [0, 3, 7, 11] and cut.lengths.tolist() == [3, 4, 4, 1]


def test_length_batches_hold_similar_lengths():
    lengths = torch.randint(1, 200, (1000,), generator=torch.Generator().manual_seed(0))
    epoch = length_batches(lengths, 8, seed=0, epoch=0, shuffle=True)
    assert epoch.shape == (125, 8) and len(set(epoch.flatten().tolist())) == 1000
    spread = (lengths[epoch].max(1).values - lengths[epoch].min(1).values).float().mean()
    assert spread < 20  # drawn at random, 8 lengths of 1 .. 200 spread over about 150
    assert torch.equal(epoch, length_batches(lengths, 8, seed=0, epoch=0, shuffle=True))
    assert not torch.equal(epoch, length_batches(lengths, 8, seed=0, epoch=1, shuffle=True))
    sorted_ = length_batches(lengths, 8, seed=0, epoch=0, shuffle=False)
    assert bool((lengths[sorted_[:GROUP_STEPS]].flatten().diff() <= 0).all())


def test_dynamic_batches_are_padded_documents_of_similar_length(dynamic, tokenizer, texts):
    documents = [[*tokenizer(text)["input_ids"], EOS] for text in texts]
    starts = {tuple(d[i : i + 128]) for d in documents for i in range(0, len(d), 128)}
    read = corpus_batches(dynamic, CORPUS, "--pad-to-multiple", "8")
    widths = set()
    for step in [*range(88), 90]:  # an epoch of 88 steps, and one step of the second
        batch = named(read(step), dynamic)
        ids, mask, labels = batch["input_ids"], batch["attention_mask"], batch["labels"]
        assert ids.shape[0] == ROWS and 8 <= ids.shape[1] <= 128 and ids.shape[1] % 8 == 0
        widths.add(ids.shape[1])
        for row in range(ROWS):
            real = int(mask[row].sum())
            assert tuple(ids[row, :real].tolist()) in starts  # a document, or a piece of one
            assert set(ids[row, real:].tolist()) <= {PAD, 0}  # the pad token; 0 rounding up
            assert set(labels[row, real:].tolist()) <= {-100}
            assert torch.equal(labels[row, :real], ids[row, :real])
            assert torch.equal(batch["position_ids"][row, :real], torch.arange(real))
        lengths = mask.sum(1)
        assert int(lengths.max() - lengths.min()) <= 64
    assert len(widths) > 1
    again = corpus_batches(dynamic, CORPUS, "--pad-to-multiple", "8")(90)[0]
    assert all(torch.equal(a, b) for a, b in zip(again, read(90)[0]))


# -- errors ----------------------------------------------------------------------------------
def refused(read: Batches, step: int = 0) -> str:
    with pytest.raises(PipelineRunError) as error:
        read(step)
    return str(error.value)


def test_no_text_column_names_the_columns_and_the_fix(static, tmp_path):
    path = tmp_path / "body.jsonl"
    path.write_text(json.dumps({"body": "sea calm", "id": 1}) + "\n")
    message = refused(corpus_batches(static, path))
    assert "no column 'text'" in message and "its columns are body, id" in message
    assert "rename_column" in message


def test_text_without_a_tokenizer_says_to_give_one(static):
    message = refused(batches(static, "--data", str(CORPUS)))
    assert "give --tokenizer DIR" in message


def test_a_corpus_too_small_for_one_batch(static, tmp_path):
    path = tmp_path / "small.jsonl"
    path.write_text("".join(json.dumps({"text": "sea calm."}) + "\n" for _ in range(5)))
    message = refused(corpus_batches(static, path))
    assert "fewer than a batch's 8 rows" in message and "give more documents" in message
    # one packed row: fewer microbatches would not do, a batch of one microbatch takes 2 rows
    assert message.endswith("give more documents, a batch of one microbatch takes 2")


def test_a_tokenizer_larger_than_the_embedding(static, tmp_path, texts):
    make_corpus.tokenizer(texts, size=120).save_pretrained(str(tmp_path / "big"))
    read = batches(static, "--data", str(CORPUS), "--tokenizer", str(tmp_path / "big"))
    message = refused(read)
    assert "its vocabulary has 120 tokens" in message
    assert "the model's token embedding (transformer.wte.weight) only 96 rows" in message


def test_missing_files_tokenizers_and_libraries(static, tmp_path, monkeypatch):
    with pytest.raises(PipelineRunError, match="no such file or directory"):
        corpus_batches(static, tmp_path / "missing.jsonl")
    with pytest.raises(PipelineRunError, match="--tokenizer .*: no such directory"):
        batches(static, "--data", str(CORPUS), "--tokenizer", str(tmp_path / "none"))
    with pytest.raises(PipelineRunError, match="tokenizes a dataset file .* neither is one"):
        batches(static, "--tokenizer", str(TOKENIZER))
    (tmp_path / "bad.jsonl").write_text("{not json\n")
    lazy = corpus_batches(static, tmp_path / "bad.jsonl")  # read at the first batch, not before
    assert "datasets could not read it" in refused(lazy)
    (tmp_path / "plain").mkdir()
    assert "save_to_disk" in refused(corpus_batches(static, tmp_path / "plain"))
    monkeypatch.setitem(sys.modules, "datasets", None)  # as if it were not installed
    assert "pip install datasets" in refused(corpus_batches(static))


def test_pipelines_a_dataset_file_cannot_feed(static, tmp_path):
    pipeline = pipeline_of(static)
    masked = Pipeline.from_json(pipeline.to_json() | {"model": "transformers.BertForMaskedLM"})
    with pytest.raises(PipelineRunError, match="BertForMaskedLM is not one"):
        row_format(masked, "corpus.jsonl", "--data")
    compile_model("mlp", tmp_path / "mlp", 2)
    with pytest.raises(PipelineRunError, match="this pipeline takes x: give --data FILE.py:FN"):
        corpus_batches(tmp_path / "mlp")


# -- training --------------------------------------------------------------------------------
def losses(log: Path) -> dict[int, float]:
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    return {e["step"]: e["loss"] for e in lines if "loss" in e}


def eval_losses(log: Path) -> list[float]:
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    return [e["eval_loss"] for e in lines if "eval_loss" in e]


@pytest.mark.slow
def test_a_packed_corpus_trains_and_resumes_mid_epoch_like_an_uninterrupted_run(
    static, forms, tmp_path
):
    """6 steps checkpointed every 3, against a run resumed from the step-3 checkpoint: steps
    3-5 have the same losses and the final held-out loss (a Parquet file) is the same."""
    common = ["--data", str(CORPUS), "--tokenizer", str(TOKENIZER), "--steps", "6"]
    common += ["--microbatches", str(MICROBATCHES), "--lr", "3e-3", "--eval-batches", "2"]
    common += ["--eval-data", str(forms["parquet"])]
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    result = run_ranks(
        static / "train.py",
        2,
        *common,
        *("--checkpoint-dir", str(whole), "--checkpoint-every", "3"),
        *("--keep-checkpoints", "0", "--log-json", str(tmp_path / "whole.jsonl")),
    )
    assert f"--data {CORPUS}: 300 documents" in result.stdout  # said once, by rank 0
    assert result.stdout.count("300 documents") == 2  # and once for --eval-data
    resumed.mkdir()
    shutil.copytree(whole / "step-00000003", resumed / "step-00000003")
    run_ranks(
        static / "train.py",
        2,
        *common,
        *("--checkpoint-dir", str(resumed), "--resume-from", "3"),
        *("--log-json", str(tmp_path / "resumed.jsonl")),
    )
    uninterrupted, continued = losses(tmp_path / "whole.jsonl"), losses(tmp_path / "resumed.jsonl")
    assert sorted(uninterrupted) == list(range(6)) and sorted(continued) == [3, 4, 5]
    assert all(continued[step] == uninterrupted[step] for step in (3, 4, 5))
    assert uninterrupted[5] < uninterrupted[0]  # it learns
    final = eval_losses(tmp_path / "whole.jsonl"), eval_losses(tmp_path / "resumed.jsonl")
    assert len(final[0]) == len(final[1]) == 1 and final[0] == final[1]
