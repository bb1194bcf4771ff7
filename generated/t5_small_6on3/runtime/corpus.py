"""Batches from a dataset on disk: ``train.py --data PATH`` (and ``--eval-data PATH``) where PATH
is a JSON Lines (``.jsonl``, ``.json``), Parquet (``.parquet``) or Arrow (``.arrow``) file, or a
directory that ``datasets``' ``save_to_disk`` wrote.

Copied into every generated pipeline as ``runtime/corpus.py``. Its module level needs only torch:
Hugging Face ``datasets`` (to read the file) and ``transformers`` (to load ``--tokenizer DIR``) are
imported when a run reads a dataset file, on the ranks that read batches, when they prepare it
(:meth:`Corpus.prepare`: the driver does so before the first step, without a timeout, while the
other ranks wait). Of a ``save_to_disk`` directory of a DatasetDict, training reads ``train`` (or
its only split), evaluation ``validation`` or ``test`` (or ``--eval-split``'s), never the
training split unasked; the line that describes the rows names the split.

The documents (a ``text`` column tokenized with ``--tokenizer``, or an ``input_ids`` column
already tokenized), in the dataset's order, each followed by the tokenizer's end-of-sequence
token, become rows of the pipeline's inputs:

- **packed**: the documents one after another, cut into rows of the pipeline's sequence length
  (the last, shorter one left out), as ``transformers``' ``run_clm`` groups texts.
  ``position_ids``, where the model takes them, restart at 0 at each document's start within a
  row (and at the row's start); ``labels`` are the ids (the model shifts them); an
  ``attention_mask`` is all ones;
- **batched by length**, for a pipeline whose sequence dimension is dynamic (compiled with
  ``--dynamic``): each document, or each piece of one longer than the dimension's upper bound, is
  a row; a step's rows have similar lengths (sorted by length in groups of
  :data:`GROUP_STEPS` steps' rows, as ``transformers``' ``group_by_length``) and are padded to the
  longest (and at least to the dimension's lower bound): ids with the pad token, ``labels`` with
  -100, the ``attention_mask`` with 0.

The rows of step N depend only on N, the seed and the options, as ``data.py``'s batches do: those
at positions N x B ... (N + 1) x B - 1 of an endless sequence of epochs, each epoch every row
once in a seeded order (held-out data: in the dataset's order). A resumed run reads the batches an
uninterrupted one would.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist

from .core.errors import PipelineRunError, first_line
from .core.pipeline import Pipeline, Value
from .evaluation import CAUSAL_SUFFIXES, IGNORE_INDEX

__all__ = [
    "CORPUS_SUFFIXES",
    "GROUP_STEPS",
    "Corpus",
    "Documents",
    "PackedRows",
    "Pieces",
    "RowFormat",
    "documents_from_ids",
    "epoch_order",
    "is_corpus",
    "length_batches",
    "packed",
    "pieces",
    "restarting_positions",
    "row_format",
    "rows_of_step",
]

#: the files a dataset may be given as (a directory: what ``save_to_disk`` wrote)
CORPUS_SUFFIXES = (".jsonl", ".json", ".parquet", ".arrow")
#: the ``datasets`` builder reading each kind of file (Arrow files are mapped as they are)
_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}
#: the column holding the documents' text, and the one holding documents already tokenized
TEXT_COLUMN = "text"
IDS_COLUMN = "input_ids"
#: the inputs a dataset file gives, by their Hugging Face names
GIVEN = ("input_ids", "labels", "attention_mask", "position_ids", "token_type_ids")
#: rows are sorted by length in groups of this many steps' rows (batched by length)
GROUP_STEPS = 50
#: documents tokenized at once
_CHUNK = 1000
#: the endings of the names Hugging Face models give their token embedding's weight
_EMBEDDINGS = (
    "wte.weight",
    "embed_tokens.weight",
    "word_embeddings.weight",
    "tok_embeddings.weight",
    "token_embedding.weight",
    "embed_in.weight",
    "shared.weight",
)
#: the seeds of the epochs' orders (as data.py's Dataset order)
_SEED_STRIDE = 1_000_003


def is_corpus(spec: str) -> bool:
    """Whether a ``--data`` value names a dataset on disk (a file of :data:`CORPUS_SUFFIXES` or a
    directory) rather than a function ``FILE.py:FN``."""
    path = Path(spec)
    return path.suffix.lower() in CORPUS_SUFFIXES or path.is_dir()


# -- documents --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Documents:
    """Tokenized documents one after another: document ``i`` is ``tokens[starts[i]:starts[i +
    1]]`` (its end-of-sequence token included)."""

    tokens: torch.Tensor  # int64, every document's tokens
    starts: torch.Tensor  # int64, the offset of each document, then the number of tokens

    @property
    def count(self) -> int:
        return len(self.starts) - 1

    @property
    def lengths(self) -> torch.Tensor:
        return self.starts[1:] - self.starts[:-1]


def documents_from_ids(ids: Iterable[Sequence[int]], eos: int | None) -> Documents:
    """The documents ``ids`` (token ids each), each followed by ``eos`` unless it ends with it
    already (None: as they are); empty documents are left out."""
    parts: list[torch.Tensor] = []
    lengths: list[int] = []
    flat: list[int] = []
    for document in ids:
        row = list(document)
        if not row:
            continue
        if eos is not None and row[-1] != eos:
            row.append(eos)
        flat.extend(row)
        lengths.append(len(row))
        if len(flat) >= 1 << 20:  # a list of Python ints takes 36 bytes a token: keep it short
            parts.append(torch.tensor(flat, dtype=torch.int64))
            flat = []
    parts.append(torch.tensor(flat, dtype=torch.int64))
    starts = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    starts[1:] = torch.tensor(lengths, dtype=torch.int64).cumsum(0)
    return Documents(torch.cat(parts), starts)


# -- packed rows ------------------------------------------------------------------------------
@dataclass(frozen=True)
class PackedRows:
    """Rows of a fixed length cut from documents one after another: ``tokens[r]`` is row ``r``,
    ``begins[r, i]`` says whether a document begins at its position ``i``."""

    tokens: torch.Tensor  # int64 [rows, length]
    begins: torch.Tensor  # bool [rows, length]


def packed(documents: Documents, length: int) -> PackedRows:
    """``documents`` cut into rows of ``length`` tokens, the last, shorter one left out."""
    rows = len(documents.tokens) // length
    begins = torch.zeros(len(documents.tokens), dtype=torch.bool)
    begins[documents.starts[:-1]] = True
    used = rows * length
    return PackedRows(documents.tokens[:used].view(rows, length), begins[:used].view(rows, length))


def restarting_positions(begins: torch.Tensor) -> torch.Tensor:
    """The position of each token of rows whose documents begin where ``begins`` (bool,
    [rows, length]) is true: 0, 1, 2, ... from each document's start, and from the row's start
    for the document the row begins inside."""
    index = torch.arange(begins.shape[-1]).expand_as(begins)
    latest = torch.where(begins, index, torch.zeros_like(index)).cummax(dim=-1).values
    return index - latest


# -- the order of rows ------------------------------------------------------------------------
@functools.lru_cache(maxsize=2)  # a step reads at most two epochs; a large one's order takes long
def epoch_order(total: int, seed: int, epoch: int) -> torch.Tensor:
    """The seeded order of ``total`` rows in epoch ``epoch`` (shared: not to be changed)."""
    generator = torch.Generator().manual_seed(seed * _SEED_STRIDE + epoch)
    return torch.randperm(total, generator=generator)


def rows_of_step(step: int, count: int, total: int, seed: int, shuffle: bool) -> torch.Tensor:
    """The ``count`` rows (indices among ``total``) of step ``step``: positions ``step x
    count`` ... of an endless sequence of epochs, each every row once, in the seeded
    :func:`epoch_order` of its epoch (in order without ``shuffle``)."""
    positions = torch.arange(step * count, (step + 1) * count)
    epochs, rows = positions // total, positions % total
    if shuffle:
        for epoch in range(int(epochs[0]), int(epochs[-1]) + 1):
            chosen = epochs == epoch
            rows[chosen] = epoch_order(total, seed, epoch)[rows[chosen]]
    return rows


# -- rows batched by length -------------------------------------------------------------------
@dataclass(frozen=True)
class Pieces:
    """Rows batched by length: row ``i`` is ``tokens[starts[i]:starts[i] + lengths[i]]`` of
    the documents' tokens, a document or a piece of one longer than the longest row."""

    starts: torch.Tensor  # int64
    lengths: torch.Tensor  # int64


def pieces(documents: Documents, longest: int) -> Pieces:
    """Each of ``documents`` whole, or cut into pieces of ``longest`` tokens (the last one
    shorter) where it is longer."""
    lengths = documents.lengths
    counts = (lengths + longest - 1) // longest
    owner = torch.repeat_interleave(torch.arange(len(lengths)), counts)
    first = torch.repeat_interleave(counts.cumsum(0) - counts, counts)
    offset = (torch.arange(len(owner)) - first) * longest
    return Pieces(
        documents.starts[:-1][owner] + offset,
        torch.clamp(lengths[owner] - offset, max=longest),
    )


def length_batches(
    lengths: torch.Tensor, count: int, seed: int, epoch: int, shuffle: bool
) -> torch.Tensor:
    """Epoch ``epoch`` of rows of ``lengths`` batched by length: ``[batches, count]`` row
    indices. The rows in the seeded :func:`epoch_order` (in order without ``shuffle``), those
    beyond whole batches left out, sorted by length (the longest first) within groups of
    :data:`GROUP_STEPS` batches, cut into batches; their order then seeded again."""
    generator = torch.Generator().manual_seed(seed * _SEED_STRIDE + epoch)
    total = len(lengths)
    order = torch.randperm(total, generator=generator) if shuffle else torch.arange(total)
    order = order[: total // count * count]
    groups = []
    for group in torch.split(order, GROUP_STEPS * count):
        ranked = torch.sort(lengths[group], descending=True, stable=True).indices
        groups.append(group[ranked].view(-1, count))
    batches = torch.cat(groups)
    if shuffle:
        batches = batches[torch.randperm(len(batches), generator=generator)]
    return batches


# -- what the pipeline takes ------------------------------------------------------------------
@dataclass(frozen=True)
class RowFormat:
    """What a pipeline's batches from a dataset file hold: the inputs (name, dtype), each of
    shape [samples, sequence]; the rows' length (packed: every row's; batched by length: the
    longest a row may be, the sequence dimension's upper bound) and the shortest a row may be;
    the model's token embedding (its tensor's name and rows) where its name shows it."""

    inputs: tuple[tuple[str, torch.dtype], ...]
    length: int
    shortest: int
    by_length: bool
    embedding: tuple[str, int] | None


def row_format(pipeline: Pipeline, source: str, option: str) -> RowFormat:
    """What ``pipeline`` takes from a dataset file, or the reason it cannot take it (an input
    a dataset file does not give, labels of a model that is not a causal language model, a loss
    taking a target)."""
    where = f"{option} {source}"
    fix = f"give {option} FILE.py:FN, a function that builds its batches"
    names = [value.name for value in pipeline.data_inputs]
    other = [name for name in names if name not in GIVEN]
    if pipeline.loss.needs_target or other or "input_ids" not in names:
        takes = ", ".join(names + (["a target for --loss"] if pipeline.loss.needs_target else []))
        raise PipelineRunError(
            f"{where}: a dataset file gives token batches ({', '.join(GIVEN)}) for a language "
            f"model that computes its own loss; this pipeline takes {takes}: {fix}",
            every_rank=True,
        )
    if "labels" in names and not pipeline.model_class.endswith(CAUSAL_SUFFIXES):
        raise PipelineRunError(
            f"{where}: a dataset file gives the labels of a causal language model (the ids, "
            f"which the model shifts); {pipeline.model_class} is not one (*ForCausalLM, "
            f"*LMHeadModel) and its labels mean something else: {fix}",
            every_rank=True,
        )
    values = list(pipeline.data_inputs)
    ids = pipeline.values["input_ids"]
    for value in values:
        if len(value.shape) != 2 or value.shape[1] != ids.shape[1]:
            raise PipelineRunError(
                f"{where}: a dataset file gives inputs of shape [samples, sequence]; this "
                f"pipeline's {value.name!r} has shape {list(value.shape)}: {fix}",
                every_rank=True,
            )
        if pipeline.batch_dim(value.name):
            raise PipelineRunError(
                f"{where}: a dataset file gives inputs of shape [samples, sequence]; this "
                f"pipeline's {value.name!r} holds its batch along dimension "
                f"{pipeline.batch_dim(value.name)} (pipeline.json's batch_dims): {fix}",
                every_rank=True,
            )
    dimension = _sequence_dimension(pipeline, values, where, fix)
    inputs = tuple((value.name, value.torch_dtype) for value in values)
    embedding = _embedding(pipeline)
    if dimension is None:
        return RowFormat(inputs, ids.shape[1], ids.shape[1], False, embedding)
    low, high, planned = dimension
    return RowFormat(inputs, high if high is not None else planned, low, True, embedding)


def _sequence_dimension(
    pipeline: Pipeline, values: list[Value], where: str, fix: str
) -> tuple[int, int | None, int] | None:
    """(lower bound, upper bound, planned size) of the dynamic dimension sizing the inputs'
    sequence, or None where the sequence length is fixed."""
    sizing = {
        value.name: next(
            (d for d in pipeline.dimensions.values() if (value.name, 1) in d.sources), None
        )
        for value in values
    }
    found = sizing["input_ids"]
    if any(d is not found for d in sizing.values()):
        raise PipelineRunError(
            f"{where}: the sequence dimension of this pipeline's inputs is not the same dynamic "
            f"dimension for all of them ({', '.join(sizing)}): compile with --dynamic naming "
            f"dimension 1 of each, or {fix}",
            every_rank=True,
        )
    return None if found is None else (found.min, found.max, found.planned)


def _embedding(pipeline: Pipeline) -> tuple[str, int] | None:
    """The model's token embedding (its weight's name and rows), found by the names Hugging
    Face models give it; None when the pipeline names none of them."""
    tensors = pipeline.identity.tensors if pipeline.identity is not None else {}
    for name, (shape, _) in tensors.items():
        if name.endswith(_EMBEDDINGS) and len(shape) == 2:
            return name, shape[0]
    return None


# -- reading ----------------------------------------------------------------------------------
def _library(name: str, why: str) -> ModuleType:
    try:
        return importlib.import_module(name)
    except ImportError:
        raise PipelineRunError(
            f"{why} needs Hugging Face {name}, which is not installed: pip install {name}"
        ) from None


def _read_dataset(source: str, option: str, held_out: bool, split: str | None) -> tuple[Any, str]:
    """The ``datasets.Dataset`` at ``source`` (a file read with its builder, an Arrow file
    mapped, or a ``save_to_disk`` directory; of a DatasetDict, the split a run takes: ``split``
    where given, see :func:`_split`), and where it is in words: ``OPTION SOURCE`` and the split
    read."""
    where = f"{option} {source}"
    datasets = _library("datasets", f"{where} (a dataset file)")
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    path = Path(source)
    saved = path.is_dir() and any(
        (path / name).is_file() for name in ("state.json", "dataset_dict.json")
    )
    if path.is_dir() and not saved:
        raise PipelineRunError(
            f"{where}: a directory must be one that datasets' save_to_disk wrote (with its "
            f"state.json or dataset_dict.json); give a file of JSON Lines, Parquet or Arrow "
            f"({', '.join(CORPUS_SUFFIXES)}) as the file itself"
        )
    try:
        if saved:
            loaded = datasets.load_from_disk(str(path))
        elif path.suffix.lower() == ".arrow":
            loaded = datasets.Dataset.from_file(str(path))
        else:
            loaded = datasets.load_dataset(
                _BUILDERS[path.suffix.lower()], data_files=str(path), split="train"
            )
    except Exception as exc:  # noqa: BLE001 - the file's problem, said with datasets' words
        raise PipelineRunError(
            f"{where}: datasets could not read it ({type(exc).__name__}: {first_line(exc)})"
        ) from None
    if isinstance(loaded, datasets.DatasetDict):
        chosen = _split(list(loaded), where, held_out, split)
        return loaded[chosen], f"{where} (its split {chosen!r})"
    if split is not None:
        raise PipelineRunError(
            f"{where}: --eval-split {split} chooses a split of a DatasetDict (a save_to_disk "
            "directory of several), and this is a single dataset: leave --eval-split out"
        )
    return loaded, where


def _split(splits: list[str], where: str, held_out: bool, split: str | None) -> str:
    """The split of a saved DatasetDict a run reads: ``split`` (``--eval-split``), else for
    training its only one or ``train``, held out ``validation`` or ``test`` (never the
    training split: a DatasetDict without a held-out split is refused, naming its splits)."""
    splits_named = ", ".join(repr(s) for s in splits)
    if split is not None:
        if split not in splits:
            raise PipelineRunError(
                f"{where}: --eval-split {split}: the DatasetDict has no such split; its splits "
                f"are {splits_named}"
            )
        return split
    if held_out:
        held = [s for s in ("validation", "test") if s in splits]
        if not held:
            raise PipelineRunError(
                f"{where}: evaluation reads the split 'validation' (or 'test') of a DatasetDict, "
                f"and this one has the splits {splits_named}: choose the held-out one with "
                "--eval-split SPLIT"
            )
        return held[0]
    chosen = splits if len(splits) == 1 else [s for s in splits if s == "train"]
    if not chosen:
        raise PipelineRunError(
            f"{where}: a DatasetDict of the splits {splits_named}, none of them 'train': save "
            "the split to train on alone (dataset[SPLIT].save_to_disk)"
        )
    return chosen[0]


def _load_tokenizer(directory: str) -> Any:
    transformers = _library("transformers", f"--tokenizer {directory}")
    try:
        return transformers.AutoTokenizer.from_pretrained(directory, local_files_only=True)
    except Exception as exc:  # noqa: BLE001 - the directory's problem, said with its words
        raise PipelineRunError(
            f"--tokenizer {directory}: transformers' AutoTokenizer could not load it "
            f"({type(exc).__name__}: {first_line(exc)}); give a directory a tokenizer's "
            "save_pretrained wrote (tokenizer.json or its vocabulary files, tokenizer_config.json)"
        ) from None


def _end_token(tokenizer: Any, directory: str) -> int:
    """The token that ends each document: the tokenizer's end-of-sequence token (or, for
    tokenizers without one, its separator)."""
    eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else tokenizer.sep_token_id
    if eos is None:
        raise PipelineRunError(
            f"--tokenizer {directory}: the tokenizer has no end-of-sequence token to separate "
            "documents: give it one (tokenizer.eos_token = ...; tokenizer.save_pretrained(DIR))"
        )
    return int(eos)


def _column(dataset: Any, column: str) -> Iterator[Any]:
    for batch in dataset.select_columns([column]).iter(batch_size=_CHUNK):
        yield from batch[column]


def _tokenized(texts: Iterable[Any], tokenizer: Any, where: str) -> Iterator[list[int]]:
    """The token ids of each of ``texts``, tokenized :data:`_CHUNK` at a time (with the
    tokenizer's special tokens, as its model was trained; a missing text is empty)."""
    chunk: list[str] = []
    for row, text in enumerate(texts):
        if not isinstance(text, str) and text is not None:
            raise PipelineRunError(
                f"{where}: row {row} of the column {TEXT_COLUMN!r} is a {type(text).__name__}, "
                "not text"
            )
        chunk.append(text or "")
        if len(chunk) == _CHUNK:
            yield from tokenizer(chunk, add_special_tokens=True, verbose=False)["input_ids"]
            chunk = []
    if chunk:
        yield from tokenizer(chunk, add_special_tokens=True, verbose=False)["input_ids"]


class Corpus:
    """The batches of ``--data PATH`` (or ``--eval-data PATH``): what the pipeline takes is
    checked when built (on every rank, before training); the dataset is read, tokenized and
    packed (or batched by length) by :meth:`prepare`, on the ranks that read batches only."""

    def __init__(
        self,
        pipeline: Pipeline,
        source: str,
        tokenizer: str | None,
        samples: int,
        seed: int,
        held_out: bool,
        option: str,
        split: str | None = None,
        fewest: int | None = None,
    ) -> None:
        """``samples``: rows of a step's batch; ``held_out``: read in order, not shuffled;
        ``split``: the split of a DatasetDict to read (``--eval-split``; None: see
        :func:`_split`); ``fewest``: rows of a step's batch of one microbatch (default: the
        example microbatch's samples)."""
        self.source, self.tokenizer, self.option = source, tokenizer, option
        self.samples, self.seed, self.held_out = samples, seed, held_out
        self.split = split
        self.where = f"{option} {source}"
        if not Path(source).exists():
            raise PipelineRunError(f"{self.where}: no such file or directory", every_rank=True)
        if tokenizer is not None and not Path(tokenizer).is_dir():
            raise PipelineRunError(
                f"--tokenizer {tokenizer}: no such directory; give a local directory a "
                "tokenizer's save_pretrained wrote (nothing is downloaded: save a Hub tokenizer "
                "first, AutoTokenizer.from_pretrained(NAME).save_pretrained(DIR))",
                every_rank=True,
            )
        self.format = row_format(pipeline, source, option)
        self.fewest = fewest or pipeline.samples_per_microbatch
        self.documents: Documents | None = None
        self.rows: PackedRows | None = None  # packed
        self.pieces: Pieces | None = None  # batched by length
        self.epoch: tuple[int, torch.Tensor] | None = None  # batched by length: the last read
        self.pad = 0  # the id rows batched by length are padded with: the tokenizer's pad token

    def __call__(self, step: int) -> dict[str, torch.Tensor]:
        """The whole batch of step ``step`` (or held-out batch ``step``), by input name."""
        self.prepare()
        if self.format.by_length:
            batch = self.batch_by_length(step)
        else:
            batch = self.packed_batch(step)
        return {name: batch[name].to(dtype) for name, dtype in self.format.inputs}

    # -- the first batch: reading, tokenizing, packing ---------------------------------------
    def prepare(self) -> None:
        """Read, tokenize and arrange the dataset, once (the driver does it before the first
        step, else the first batch does)."""
        if self.documents is None:
            documents = self.read()
            self.arrange(documents)
            self.documents = documents

    @property
    def batches_per_epoch(self) -> int:
        """Whole batches in one pass over the rows (once prepared)."""
        if self.format.by_length:
            assert self.pieces is not None  # prepared
            return len(self.pieces.lengths) // self.samples
        assert self.rows is not None  # prepared
        return len(self.rows.tokens) // self.samples

    def read(self) -> Documents:
        """The dataset's documents, tokenized, each followed by the end-of-sequence token."""
        dataset, self.where = _read_dataset(self.source, self.option, self.held_out, self.split)
        columns = list(dataset.column_names)
        tokenizer = _load_tokenizer(self.tokenizer) if self.tokenizer is not None else None
        eos = _end_token(tokenizer, str(self.tokenizer)) if tokenizer is not None else None
        ids: Iterable[Sequence[int]]
        if IDS_COLUMN in columns:
            ids = _column(dataset, IDS_COLUMN)
        elif TEXT_COLUMN in columns:
            if tokenizer is None:
                raise PipelineRunError(
                    f"{self.where}: its {TEXT_COLUMN!r} column is text, to be tokenized: give "
                    "--tokenizer DIR, a directory transformers' AutoTokenizer.from_pretrained "
                    "loads (one the model's tokenizer.save_pretrained wrote)"
                )
            ids = _tokenized(_column(dataset, TEXT_COLUMN), tokenizer, self.where)
        else:
            raise PipelineRunError(
                f"{self.where}: no column {TEXT_COLUMN!r} (documents as text) nor {IDS_COLUMN!r} "
                f"(documents tokenized); its columns are {', '.join(columns) or 'none'}: name "
                f"the column of the documents {TEXT_COLUMN!r} (datasets: "
                f"dataset.rename_column(NAME, {TEXT_COLUMN!r}), then save it)"
            )
        if tokenizer is not None and eos is not None:
            pad = tokenizer.pad_token_id
            self.pad = int(pad) if pad is not None else eos
        documents = documents_from_ids(ids, eos)
        if not documents.count:
            raise PipelineRunError(f"{self.where}: the dataset holds no documents")
        self.check_vocabulary(documents, tokenizer)
        return documents

    def check_vocabulary(self, documents: Documents, tokenizer: Any) -> None:
        """The tokenizer's vocabulary and the documents' ids fit the model's token embedding."""
        if self.format.embedding is None:
            return
        name, rows = self.format.embedding
        if tokenizer is not None and len(tokenizer) > rows:
            raise PipelineRunError(
                f"--tokenizer {self.tokenizer}: its vocabulary has {len(tokenizer)} tokens, the "
                f"model's token embedding ({name}) only {rows} rows: use the model's tokenizer "
                f"(at most {rows} tokens), or compile a model of a vocabulary (vocab_size) of at "
                f"least {len(tokenizer)}"
            )
        highest = int(documents.tokens.max())
        if highest >= rows:
            raise PipelineRunError(
                f"{self.where}: token id {highest} is beyond the model's token embedding "
                f"({name}, {rows} rows): tokenize the documents with the model's tokenizer"
            )

    def arrange(self, documents: Documents) -> None:
        """The documents as rows (packed, or pieces batched by length), with a line saying so
        (from global rank 0); a dataset too small for one batch is refused."""
        length, samples = self.format.length, self.samples
        if self.format.by_length:
            self.pieces = pieces(documents, length)
            total, what = len(self.pieces.lengths), f"rows of up to {length} tokens"
        else:
            self.rows = packed(documents, length)
            total, what = len(self.rows.tokens), f"packed rows of {length} tokens"
        if total < samples:
            fewer = (
                "or fewer --microbatches"
                if total >= self.fewest
                else f"a batch of one microbatch takes {self.fewest}"
            )
            raise PipelineRunError(
                f"{self.where}: its {documents.count} documents ({len(documents.tokens)} tokens) "
                f"give {total} {what}, fewer than a batch's {samples} rows (--microbatches x "
                f"--accumulate x --dp x --dp-shard x the example's samples): give more "
                f"documents, {fewer}"
            )
        if not dist.is_initialized() or dist.get_rank() == 0:
            print(
                f"{self.where}: {documents.count:,} documents, {len(documents.tokens):,} tokens, "
                f"{total:,} {what}: {total // samples:,} batches an epoch",
                flush=True,
            )

    # -- batches -----------------------------------------------------------------------------
    def packed_batch(self, step: int) -> dict[str, torch.Tensor]:
        """Step ``step``'s packed rows: ``positions`` restart at each document's start."""
        assert self.rows is not None  # arranged at the first batch
        chosen = rows_of_step(
            step, self.samples, len(self.rows.tokens), self.seed, not self.held_out
        )
        tokens = self.rows.tokens[chosen]
        return {
            "input_ids": tokens,
            "labels": tokens.clone(),
            "attention_mask": torch.ones_like(tokens),
            "position_ids": restarting_positions(self.rows.begins[chosen]),
            "token_type_ids": torch.zeros_like(tokens),
        }

    def batch_by_length(self, step: int) -> dict[str, torch.Tensor]:
        """Step ``step``'s rows of similar lengths, padded to the longest (at least to the
        dimension's lower bound)."""
        assert self.pieces is not None and self.documents is not None  # arranged at the first
        per_epoch = len(self.pieces.lengths) // self.samples
        epoch, index = divmod(step, per_epoch)
        if self.epoch is None or self.epoch[0] != epoch:
            shuffle = not self.held_out
            lengths = self.pieces.lengths
            self.epoch = epoch, length_batches(lengths, self.samples, self.seed, epoch, shuffle)
        chosen = self.epoch[1][index]
        starts, lengths = self.pieces.starts[chosen], self.pieces.lengths[chosen]
        width = max(int(lengths.max()), self.format.shortest)
        tokens = self.documents.tokens
        ids = torch.full((len(chosen), width), self.pad, dtype=torch.int64)
        for row, (start, length) in enumerate(zip(starts.tolist(), lengths.tolist())):
            ids[row, :length] = tokens[start : start + length]
        real = torch.arange(width) < lengths[:, None]
        return {
            "input_ids": ids,
            "labels": torch.where(real, ids, IGNORE_INDEX),
            "attention_mask": real.long(),
            "position_ids": torch.arange(width).expand(len(chosen), width).clone(),
            "token_type_ids": torch.zeros_like(ids),
        }
