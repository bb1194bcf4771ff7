"""Build the small text corpus and tokenizer that the dataset-file examples and tests use.
Nothing is downloaded: the documents come from the sentences written below, and the tokenizer is
trained on them.

    python examples/data/make_corpus.py [OUT_DIR]

writes, into ``OUT_DIR`` (default: this script's folder):

- ``corpus.jsonl``: a few hundred short documents, one JSON object ``{"text": ...}`` per line. Each
  is a note from the log of a harbour on a made-up coast: the weather, the boats, the catch, the
  market, and now and then a recipe or a letter. Choices are drawn with a fixed seed, so the file
  is the same on every machine.
- ``tokenizer/``: a byte-pair-encoding tokenizer of 96 tokens (``<unk>``, ``<eos>``, ``<pad>``,
  lowercase characters and their commonest pairs), trained on the corpus with the ``tokenizers``
  library and saved with ``transformers``' ``save_pretrained``, so that
  ``AutoTokenizer.from_pretrained("examples/data/tokenizer")`` loads it. 96 tokens fit the small
  test models (the GPT-2 of tests/models.py has 97) and every example model.

Train on them with a package compiled from a causal language model, e.g. ``model.py`` here::

    autopipe compile examples/data/model.py:build --stages 2 --out out/corpus_2
    torchrun --nproc-per-node=2 out/corpus_2/train.py --data examples/data/corpus.jsonl \\
        --tokenizer examples/data/tokenizer --steps 200 --lr 3e-3 --device cpu
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

#: documents in the corpus, and tokens in the tokenizer's vocabulary
DOCUMENTS = 300
VOCABULARY = 96
SEED = 27
SPECIAL = ("<unk>", "<eos>", "<pad>")

HARBOURS = ("Kellan", "Moray Sound", "Tarrow", "Blackwater", "Sallow Point", "Orrin Bay")
BOATS = ("the Heron", "the Little Ann", "the Grey Gull", "the Margery", "the North Star")
FISH = ("herring", "mackerel", "cod", "crab", "sprat", "whiting", "lobster")
WINDS = ("north", "north east", "east", "south east", "south", "south west", "west", "north west")
SKIES = ("clear", "hazy", "grey", "low and heavy", "broken", "bright after rain")
SEAS = ("calm", "slight", "moderate", "rough", "very rough")
PEOPLE = ("Ada", "Tom", "Morwen", "Elis", "Joan", "Piran", "Bess", "Hugh")
GOODS = ("salt", "rope", "tar", "bread", "apples", "wool", "candles", "nets")
DAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")


def sentence(words: str) -> str:
    """``words`` at the start of a sentence: its first letter a capital."""
    return words[0].upper() + words[1:]


def weather(rng: random.Random) -> str:
    wind, sky, sea = rng.choice(WINDS), rng.choice(SKIES), rng.choice(SEAS)
    force = rng.randint(2, 8)
    lines = [
        f"Wind {wind}, force {force}. Sky {sky}. Sea {sea}.",
        rng.choice(
            [
                "The glass is falling slowly.",
                "The glass is steady.",
                "The glass rose in the night.",
            ]
        ),
    ]
    if force >= 6:
        lines.append("The small boats stayed in, and the harbour master closed the outer gate.")
    else:
        lines.append(f"{sentence(rng.choice(BOATS))} went out at first light.")
    return " ".join(lines)


def catch(rng: random.Random) -> str:
    boat = rng.choice(BOATS)
    fish = rng.sample(FISH, k=rng.randint(1, 3))
    boxes = [rng.randint(2, 40) for _ in fish]
    landed = ", ".join(f"{n} boxes of {f}" for n, f in zip(boxes, fish))
    lines = [f"{sentence(boat)} came in on the evening tide with {landed}."]
    if sum(boxes) > 50:
        lines.append("A good day: the buyers from the town took it all before dark.")
    else:
        lines.append(rng.choice(["A thin day.", "Not much, but the nets came back whole."]))
    return " ".join(lines)


def market(rng: random.Random) -> str:
    person, good = rng.choice(PEOPLE), rng.choice(GOODS)
    price = rng.randint(2, 19)
    lines = [
        f"At the market on {rng.choice(DAYS)}, {person} sold {good} at {price} pence the pound.",
        rng.choice(
            [
                "Prices were higher than last week.",
                "Prices held.",
                "There was little to buy and less to sell.",
                "The stalls were full until noon.",
            ]
        ),
    ]
    return " ".join(lines)


def recipe(rng: random.Random) -> str:
    fish = rng.choice(FISH)
    steps = [
        f"To cook {fish} the harbour way: clean the fish and rub it with salt.",
        rng.choice(["Lay it on a bed of onions.", "Wrap it in leaves with a little butter."]),
        f"Bake it for {rng.randint(10, 40)} minutes, or until the flesh comes away from the bone.",
        rng.choice(["Serve it with bread.", "Serve it hot, with potatoes and a glass of cider."]),
    ]
    return " ".join(steps[: rng.randint(2, 4)])


def letter(rng: random.Random) -> str:
    writer, reader = rng.sample(PEOPLE, k=2)
    harbour = rng.choice(HARBOURS)
    return (
        f"Dear {reader}, we reached {harbour} on {rng.choice(DAYS)}. "
        f"{weather(rng)} "
        f"Send word when {rng.choice(BOATS)} is mended. Yours, {writer}."
    )


KINDS = (weather, catch, market, recipe, letter)


def document(rng: random.Random, number: int) -> str:
    """One log entry: a heading and one to four notes."""
    heading = f"{rng.choice(HARBOURS)}, entry {number + 1}."
    notes = [rng.choice(KINDS)(rng) for _ in range(rng.randint(1, 4))]
    return " ".join([heading, *notes])


def documents(count: int = DOCUMENTS, seed: int = SEED) -> list[str]:
    rng = random.Random(seed)
    return [document(rng, number) for number in range(count)]


def tokenizer(texts: list[str], size: int = VOCABULARY) -> PreTrainedTokenizerFast:
    """A byte-pair-encoding tokenizer of ``size`` tokens trained on ``texts``: text is
    lowercased, spaces become ``▁`` as in SentencePiece, characters outside the corpus are
    ``<unk>``; ``<eos>`` ends documents and ``<pad>`` pads batches."""
    model = Tokenizer(models.BPE(unk_token="<unk>"))
    model.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Lowercase()])
    model.pre_tokenizer = pre_tokenizers.Metaspace()
    model.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(
        vocab_size=size, special_tokens=list(SPECIAL), show_progress=False
    )
    model.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=model, unk_token="<unk>", eos_token="<eos>", pad_token="<pad>"
    )


def main(out: Path) -> None:
    texts = documents()
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "corpus.jsonl", "w", encoding="utf-8") as file:
        for text in texts:
            file.write(json.dumps({"text": text}) + "\n")
    built = tokenizer(texts)
    assert len(built) <= VOCABULARY, len(built)
    built.save_pretrained(str(out / "tokenizer"))
    size = (out / "corpus.jsonl").stat().st_size
    print(f"wrote {len(texts)} documents ({size} bytes) and a tokenizer of {len(built)} tokens")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parent)
