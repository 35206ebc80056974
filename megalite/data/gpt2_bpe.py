"""GPT-2's byte-level BPE from its two files, vocab.json and merges.txt (Megatron's
GPT2BPETokenizer): written once as an equivalent Hugging Face tokenizer.json, which megalite's
`HFTokenizer` then reads like any other.

The tokenizer.json is what checkpoints copy and worker processes load, so it lives in a cache
keyed by the two files' contents (`$MEGALITE_CACHE`, else `$XDG_CACHE_HOME/megalite`, else
~/.cache/megalite). The ids are GPT-2's: the pre-tokenizer splits text with GPT-2's regular
expression over UTF-8 bytes mapped to printable characters, and merges apply by rank, as in
OpenAI's encoder that Megatron's tokenizer follows. `<|endoftext|>` ends documents.
"""

import json
import os
from hashlib import sha256
from pathlib import Path

from megalite.errors import MegaliteError

EOD = "<|endoftext|>"


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
    key = sha256(len(raw[0]).to_bytes(8, "little") + raw[0] + raw[1]).hexdigest()[:16]
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
    # GPT-2: no prefix space, GPT-2's split regex, byte-level decoding back to the text
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    if EOD in vocab:
        tok.add_special_tokens([EOD])  # keeps its id in vocab.json
    return tok
