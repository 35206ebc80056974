"""GPT-2's byte-level BPE from its two files, vocab.json and merges.txt (Megatron's
GPT2BPETokenizer): written once as a Hugging Face tokenizer.json, which megalite's `HFTokenizer`
then reads like any other, and encoded the way OpenAI's encoder does (`WordEncoder`).

The tokenizer.json is what checkpoints copy and worker processes load, so it lives in a cache
keyed by the two files' contents (`$MEGALITE_CACHE`, else `$XDG_CACHE_HOME/megalite`, else
~/.cache/megalite). The ids are GPT-2's: text is split with GPT-2's regular expression evaluated
by the `regex` package, as OpenAI's encoder, Megatron's legacy GPT2BPETokenizer and transformers'
slow GPT2Tokenizer do, and each piece's UTF-8 bytes, mapped to printable characters, are merged
by rank. The tokenizers package's own split (the ByteLevel pre-tokenizer) uses other Unicode
tables: letters added in recent Unicode versions (U+A7CE, U+A7CF, ...) are not letters there, so
"\ua7cf", is one piece for it and three for GPT-2. `<|endoftext|>` ends documents.
"""

import json
import os
from hashlib import sha256
from itertools import chain
from pathlib import Path

from megalite.errors import MegaliteError

EOD = "<|endoftext|>"
# OpenAI's GPT-2 split (encoder.py), as Megatron's and transformers' GPT-2 tokenizers use it
PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
_FORMAT = 2  # of the cached tokenizer.json: part of its key, so older caches are not read


def cache_dir() -> Path:
    if os.environ.get("MEGALITE_CACHE"):
        return Path(os.environ["MEGALITE_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "megalite"


def tokenizer_json(vocab_file: str | os.PathLike, merge_file: str | os.PathLike) -> Path:
    """The tokenizer.json of GPT-2's BPE over `vocab_file` and `merge_file`, built on first use."""
    files = {"--vocab-file": vocab_file, "--merge-file": merge_file}
    for flag, path in files.items():
        if path is None or not os.path.isfile(path):
            raise MegaliteError(
                f"GPT2BPETokenizer needs {flag} (GPT-2's "
                f"{'vocab.json' if flag == '--vocab-file' else 'merges.txt'}); "
                f"{'it is missing' if path is None else f'{path} does not exist'}"
            )
    raw = [Path(p).read_bytes() for p in files.values()]
    key = sha256(bytes([_FORMAT]) + len(raw[0]).to_bytes(8, "little") + raw[0] + raw[1])
    key = key.hexdigest()[:16]
    out = cache_dir() / "gpt2-bpe" / key / "tokenizer.json"
    if out.is_file():
        return out
    text = _build(vocab_file, merge_file).to_str()
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(out.name + f".tmp{os.getpid()}")
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, out)  # ranks building it at once each rename a complete, equal file
    except OSError as e:
        raise MegaliteError(
            f"cannot write the tokenizer cache {out.parent} ({e.strerror}); set MEGALITE_CACHE "
            "to a writable directory"
        ) from None
    return out


def _build(vocab_file, merge_file):
    try:
        import tokenizers  # optional: only Hugging Face tokenizers need it
    except ImportError:
        raise MegaliteError(
            "GPT2BPETokenizer needs the tokenizers package; pip install tokenizers (or megalite[hf])"
        ) from None
    try:
        vocab = json.loads(Path(vocab_file).read_text(encoding="utf-8"))
        merges = tokenizers.models.BPE.read_file(str(vocab_file), str(merge_file))[1]
    except Exception as e:  # a JSON error or tokenizers' own exception for a bad merges file
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise MegaliteError(
            f"{vocab_file} and {merge_file} are not GPT-2's vocab.json and merges.txt ({first})"
        ) from None
    if not isinstance(vocab, dict):
        raise MegaliteError(f"{vocab_file} is not GPT-2's vocab.json (a JSON object of pieces)")
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(vocab, merges))
    # GPT-2: no prefix space, GPT-2's split, byte-level decoding back to the text. A Sequence of
    # the one ByteLevel step means the same to tokenizers and transformers (which cannot take
    # GPT-2's split with `regex`'s tables) and tells megalite to encode with `WordEncoder`.
    pre = tokenizers.pre_tokenizers
    tok.pre_tokenizer = pre.Sequence([pre.ByteLevel(add_prefix_space=False)])
    tok.decoder = tokenizers.decoders.ByteLevel()
    if EOD in vocab:
        tok.add_special_tokens([EOD])  # keeps its id in vocab.json
    return tok


_MARK = {"type": "Sequence", "pretokenizers": [
    {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
]}  # fmt: skip


def is_gpt2_bpe(tok) -> bool:
    """Whether the tokenizers.Tokenizer `tok` is a tokenizer.json written by `tokenizer_json`."""
    pre = tok.pre_tokenizer
    return (
        pre is not None
        and type(pre).__name__ == "Sequence"
        and (json.loads(pre.__getstate__()) == _MARK)
    )


class WordEncoder:
    """GPT-2's encoding of text with the BPE model of the tokenizers.Tokenizer `tok`: the text
    split with `PATTERN` by the `regex` package, then each piece's ids.

    Text repeats its words, so the ids of each piece are kept in a dict (up to `max_words`
    pieces; it is emptied when full, which keeps memory bounded on a corpus of rare words): most
    pieces cost one lookup, and only new ones go to the BPE model, in one batch per call.
    """

    def __init__(self, tok, max_words: int = 1 << 20):
        try:
            import regex  # what GPT-2's pattern was written for: \p{L} with current tables
        except ImportError:
            raise MegaliteError(
                "GPT2BPETokenizer needs the regex package; pip install regex (or megalite[hf])"
            ) from None
        import tokenizers

        self._split = regex.compile(PATTERN).findall
        # the same BPE model on one piece at a time: bytes mapped, no further split, no specials
        self._bpe = tokenizers.Tokenizer(tok.model)
        self._bpe.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(
            add_prefix_space=False, use_regex=False
        )
        self._ids: dict[str, list[int]] = {}
        self.max_words = max_words

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        ids = self._ids
        if len(ids) > self.max_words:
            ids.clear()
        pieces = [self._split(t) for t in texts]
        new = list({p for ps in pieces for p in ps if p not in ids})
        if new:
            for p, enc in zip(new, self._bpe.encode_batch_fast(new, add_special_tokens=False)):
                ids[p] = enc.ids
        get = ids.__getitem__
        return [list(chain.from_iterable(map(get, ps))) for ps in pieces]
