"""GPT-2's BPE gives the reference's ids on every input, on characters whose Unicode class differs
between regular-expression tables and on a corpus; the tokenizer.json a checkpoint copies encodes
the same way.

The oracle is OpenAI's encoder as transformers ships it in Python: GPT-2's split under `regex`,
then merges by rank (Megatron's legacy GPT2BPETokenizer is the same code). transformers 5's
GPT2Tokenizer is backed by the tokenizers package, so the oracle is assembled from the
regex-based ClvpTokenizer's pieces (its split, byte map and `bpe`), leaving out its English
normaliser. Megatron-LM's own tool is compared on a large corpus by bench/data/bench_data.py
(megatron-core does not ship that tokenizer)."""

import sys
import unicodedata
from pathlib import Path

import pytest

from megalite.data import corpus
from megalite.data.tokenizer import load_tokenizer

pytest.importorskip("tokenizers")
regex = pytest.importorskip("regex")
transformers = pytest.importorskip("transformers")

BENCH = Path(__file__).resolve().parents[2] / "bench" / "data"
# Letters in the `regex` package's tables that older tables (the tokenizers package's) do not
# know: U+A7CE/U+A7CF (Unicode 16) made 3 of 60,760 documents of a real corpus differ.
GPT2_SPLIT = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
NEW_LETTERS = "\ua7ce\ua7cf\ua7d2\ua7d4\U0001e5d0\u1c89\u1c8a"


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGALITE_CACHE", str(tmp_path / "cache"))


def _generated(mb, seed):
    """Documents of the bench's generated corpus: Zipf words, some ending in U+A7CE/U+A7CF."""
    sys.path.insert(0, str(BENCH))
    try:
        import text_corpus
    finally:
        sys.path.remove(str(BENCH))
    return list(text_corpus.documents(mb, seed=seed, lexicon_size=5000))


@pytest.fixture(scope="module")
def gpt2_files(tmp_path_factory):
    """A GPT-2-style vocab.json + merges.txt trained by the tokenizers package on generated
    text. Its trainer splits with its own tables, so it learns merges across a new letter and
    the punctuation beside it ('"\ua7cf",' is one word to it): what made real corpora differ."""
    from tokenizers.implementations import ByteLevelBPETokenizer

    d = tmp_path_factory.mktemp("gpt2")
    docs = _generated(0.3, seed=1) + ['"\ua7cf", (\ua7ce\ua7cf) ' * 300]
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(docs, vocab_size=800, special_tokens=["<|endoftext|>"])
    bpe.save_model(str(d))
    return str(d / "vocab.json"), str(d / "merges.txt")


class _OpenAIEncoder:
    def __init__(self, vocab, merges):
        from transformers.models.clvp.tokenization_clvp import ClvpTokenizer

        self.t = ClvpTokenizer(vocab, merges)
        assert self.t.pat.pattern == GPT2_SPLIT  # compiled by `regex`

    def encode(self, text):
        t = self.t
        pieces = ("".join(t.byte_encoder[b] for b in p.encode()) for p in t.pat.findall(text))
        return [t.encoder[m] for p in pieces for m in t.bpe(p).split(" ")]


def _slow(gpt2_files):
    return _OpenAIEncoder(*gpt2_files)


def test_letters_new_to_unicode_split_as_gpt2_does(gpt2_files):
    # the case that differed: `"\ua7cf",` is '"', '\ua7cf', '",' for GPT-2's split
    assert regex.compile(r"\p{L}").fullmatch("\ua7cf"), "regex's tables are older than Unicode 16"
    tok, slow = load_tokenizer(None, "GPT2BPETokenizer", *gpt2_files), _slow(gpt2_files)
    texts = ['"\ua7cf",', "x\ua7ce\ua7cf!", f" {NEW_LETTERS} a{NEW_LETTERS}1 ({NEW_LETTERS})"]
    texts += [f"{c}'s {c}{c}, 9{c}" for c in NEW_LETTERS]
    for text in texts:
        assert tok.encode(text) == slow.encode(text), ascii(text)
        assert tok.decode(tok.encode(text)) == text
    # the cached tokenizer.json, as a checkpoint copies it, is still GPT-2's split
    copy = load_tokenizer(tok.model_path)
    assert [copy.encode(t) for t in texts] == [slow.encode(t) for t in texts]


def _unicode_sample():
    """One character of every general category in every block of the BMP and beyond (the
    letters, digits, marks and spaces that GPT-2's classes depend on), surrogates left out."""
    seen, out = set(), []
    for cp in range(0x20, 0x32000):
        c = chr(cp)
        cat = unicodedata.category(c)
        if cat == "Cs" or (cp >> 7, cat) in seen:
            continue
        seen.add((cp >> 7, cat))
        out.append(c)
    return "".join(out)


def test_corpus_ids_equal_transformers_slow_gpt2(gpt2_files):
    tok, slow = load_tokenizer(None, "GPT2BPETokenizer", *gpt2_files), _slow(gpt2_files)
    files = corpus.stdlib_files(max_bytes=200_000)
    docs = [f.read_text(encoding="utf-8") for f in files][:30] + _generated(0.2, seed=0)
    # a source file holding the new letters, as the real corpus that differed had
    docs.append(docs[0].replace("(", '("\ua7cf", \ua7ce\ua7cf(').replace(" = ", " = \ua7ce"))
    sample = _unicode_sample()
    # every character class next to letters, digits, spaces and punctuation
    docs += [sample, " ".join(sample), "a".join(sample), "1".join(sample), ",".join(sample)]
    docs += ["", " ", "\n\n\n", "  x  \t\n y", "it's I'LL we'd 'S"]
    ids = tok.encode_batch(docs, num_threads=1)
    assert ids == [slow.encode(d) for d in docs]
    assert sum(map(len, ids)) > 100_000  # a corpus, not a handful of words


def test_word_cache_is_bounded_and_gives_the_same_ids(gpt2_files):
    tok = load_tokenizer(None, "GPT2BPETokenizer", *gpt2_files)
    text = (Path(corpus.stdlib_root()) / "textwrap.py").read_text()
    first = tok.encode(text)
    tok._words.max_words = 10  # emptied before each call once past 10 pieces
    again = [tok.encode(text) for _ in range(3)]
    assert again == [first] * 3 and len(tok._words._ids) < len(text)
