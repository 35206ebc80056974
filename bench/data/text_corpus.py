"""A generated JSONL corpus where words recur as in real text, and a GPT-2-style BPE trained on it.

Real corpora follow Zipf's law: a few thousand words make most of the text and a long tail is
seen once or twice. Tokenizers that cache the BPE of whole words gain on such text and not on
random characters, so a benchmark corpus must have that shape. The lexicon is made of random
syllables (Latin, with accented, Cyrillic, Greek, CJK and a few U+A7CE/U+A7CF words, whose
Unicode class differs between regular-expression tables), drawn with Zipf-Mandelbrot weights;
documents get punctuation, digits, paragraphs and now and then a line of code. The same seed
gives the same bytes.

    python bench/data/text_corpus.py OUT.jsonl --mb 1024 [--vocab-dir DIR]
"""

import argparse
import json
import os
from pathlib import Path

import numpy as np

_CONS = list("bcdfghjklmnprstvwz") + ["th", "st", "ch", "sh", "br", "tr", "qu"]
_VOWELS = list("aeiouy") + ["ea", "ou", "ai"]
_OTHER = [
    "абвгдежзиклмнопрстуфхцчшэюя",
    "αβγδεζηθικλμνξοπρστυφχψω",
    "漢字かなカナ中文日本語",
    "éèàüößñç",
]
_CODE = ["def f(x):\n    return x ** 2\n", "if (a[i] != b) { c += 1; }\n", "x = {'k': [1, 2]}\n"]


def lexicon(n: int, rng) -> np.ndarray:
    """`n` words, the most frequent first (short words are the common ones)."""
    syl = 1 + np.minimum(4, rng.exponential(0.6 + np.log10(np.arange(n) + 10) / 2).astype(int))
    cons = np.array(_CONS, dtype=object)[rng.integers(len(_CONS), size=(n, 5))]
    vow = np.array(_VOWELS, dtype=object)[rng.integers(len(_VOWELS), size=(n, 5))]
    u = rng.random(n)
    words = []
    for r in range(n):
        w = "".join(cons[r, : syl[r]] + vow[r, : syl[r]])
        if u[r] < 0.02:  # another script, or the accented Latin of European languages
            alpha = _OTHER[r % len(_OTHER)]
            w = "".join(alpha[(ord(c) * 7 + i) % len(alpha)] for i, c in enumerate(w[::2]))
        elif u[r] < 0.0201:
            w += "\ua7ce\ua7cf"  # letters in Unicode 16, not in older tables
        elif u[r] < 0.08:
            w = w.capitalize()
        words.append(w)
    punct = [",", ".", "\n\n", ";", "(", ")", "'s", "—", ":", "?", '"', "12", "2024", "3.5"]
    return np.array(punct + words, dtype=object)


def documents(mb: float, seed: int = 0, lexicon_size: int = 400_000):
    """Yield documents (str) until about `mb` MiB of text."""
    rng = np.random.default_rng(seed)
    lex = lexicon(lexicon_size, rng)
    ranks = np.arange(1, len(lex) + 1, dtype=np.float64)
    cdf = np.cumsum(1.0 / (ranks + 2.7) ** 1.07)
    cdf /= cdf[-1]
    total, limit = 0, mb * 2**20
    while total < limit:
        n = int(rng.lognormal(7.5, 0.9)) + 5  # words; median ~1,800
        text = " ".join(lex[np.searchsorted(cdf, rng.random(n))])
        for a, b in ((" ,", ","), (" .", "."), (" ;", ";"), (" :", ":"), (" '", "'"),
                     ("\n\n ", "\n\n"), (" \n", "\n"), ("( ", "(")):  # fmt: skip
            text = text.replace(a, b)
        if rng.random() < 0.2:
            text += "\n\n" + _CODE[int(rng.integers(len(_CODE)))] * int(rng.integers(1, 4))
        total += len(text.encode())
        yield text


def write_corpus(out: str | os.PathLike, mb: float, seed: int = 0) -> Path:
    out = Path(out)
    tmp = out.with_name(out.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        for text in documents(mb, seed):
            fh.write(json.dumps({"text": text}, ensure_ascii=False) + "\n")
    os.replace(tmp, out)
    return out


def train_gpt2_files(out_dir: str | os.PathLike, mb: float = 16, vocab_size: int = 50_257):
    """vocab.json + merges.txt of a byte-level BPE (GPT-2's layout; `<|endoftext|>` is id 0)
    trained with the tokenizers package on `mb` MiB of this corpus (another seed)."""
    from tokenizers.implementations import ByteLevelBPETokenizer

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(documents(mb, seed=1), vocab_size=vocab_size, show_progress=False,
                            special_tokens=["<|endoftext|>"])  # fmt: skip
    bpe.save_model(str(out_dir))
    return out_dir / "vocab.json", out_dir / "merges.txt"


def main():
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    ap.add_argument("out")
    ap.add_argument("--mb", type=float, default=1024)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vocab-dir", help="also train vocab.json + merges.txt here")
    args = ap.parse_args()
    write_corpus(args.out, args.mb, args.seed)
    if args.vocab_dir:
        train_gpt2_files(args.vocab_dir)


if __name__ == "__main__":
    main()
