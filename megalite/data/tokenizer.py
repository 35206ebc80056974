"""Tokenizers: sentencepiece (round-trips any text; trained here) and Hugging Face `tokenizers`.

`load_tokenizer(path, kind)` opens either (and GPT-2's BPE from vocab.json + merges.txt, as a
Hugging Face one: gpt2_bpe.py); both classes have the same interface (`encode`, `encode_batch`,
`decode`, `vocab_size`, `bos_id`, `eos_id`, `unk_id`, `pad_id`, `model_path`, `kind`,
`file_name`, `fingerprint`), so callers never ask which one they hold.
"""

import os
from collections.abc import Iterator
from hashlib import sha256
from pathlib import Path

import sentencepiece as spm

from megalite.data import gpt2_bpe, sp_train
from megalite.data.corpus import iter_documents
from megalite.errors import MegaliteError

_META = "\u2581"  # sentencepiece's whitespace symbol
SENTENCEPIECE, HUGGINGFACE, GPT2BPE = "sentencepiece", "huggingface", "GPT2BPETokenizer"
# Megatron-LM's --tokenizer-type names are accepted too, so its command lines carry over.
# SentencePieceTokenizer is read as Megatron-core reads it today: the model's own pieces and its
# </s> as end of document (Megatron's legacy wrapper added <EOD> and friends past the vocabulary).
KINDS = {
    SENTENCEPIECE: SENTENCEPIECE,
    "GPTSentencePieceTokenizer": SENTENCEPIECE,
    "SentencePieceTokenizer": SENTENCEPIECE,
    HUGGINGFACE: HUGGINGFACE,
    "HuggingFaceTokenizer": HUGGINGFACE,
    GPT2BPE: GPT2BPE,  # vocab.json + merges.txt, read as a Hugging Face tokenizer
}
# Text whose ids (with the vocabulary size and the specials) identify a tokenizer whatever file
# holds it: a checkpoint's tokenizer.json copy fingerprints as the vocab.json/merges.txt it came
# from. Code, digits, whitespace runs and non-Latin text reach most of a vocabulary's rules.
_PROBE = (
    "The quick brown fox jumps over the lazy dog. 1234567890 3.14159\n"
    "def f(x):\n    return {'a': [x ** 2, None]}  # done\n\tTabs\r\n  spaces   here\n"
    "Übergrößenträger naïve café 漢字かなカナ 한국어 русский ελληνικά عربى 🙂 ½ ∑\n"
)


def fingerprint(tok) -> str:
    """16 hex digits naming what `tok` does (see _PROBE); datasets record it (indexed_dataset)."""
    facts = f"{tok.vocab_size} {tok.eos_id} {tok.bos_id} {tok.encode(_PROBE)}"
    return sha256(facts.encode()).hexdigest()[:16]


class Tokenizer:
    """A sentencepiece model: `encode`/`decode` and the ids of its special pieces."""

    kind = SENTENCEPIECE
    file_name = "tokenizer.model"  # its name inside checkpoints and the data cache

    def __init__(self, model_path: str | os.PathLike):
        self.model_path = str(model_path)
        if os.path.isdir(self.model_path):
            raise MegaliteError(
                f"{self.model_path} is a directory; a sentencepiece tokenizer is one .model file"
            )
        if not os.path.isfile(self.model_path):
            raise MegaliteError(
                f"tokenizer model {self.model_path} does not exist; pass a sentencepiece .model, "
                "a Hugging Face tokenizer.json or a directory holding one to --tokenizer-model"
            )
        self.sp = spm.SentencePieceProcessor()
        try:
            self.sp.Load(self.model_path)
        except (OSError, RuntimeError):
            raise MegaliteError(
                f"{self.model_path} is not a sentencepiece model; pass the .model file written "
                "by sentencepiece or tools/preprocess_data.py --train-tokenizer"
            ) from None

    @property
    def vocab_size(self) -> int:
        return self.sp.GetPieceSize()

    @property
    def bos_id(self) -> int:
        return self.sp.bos_id()

    @property
    def eos_id(self) -> int:
        return self.sp.eos_id()

    @property
    def unk_id(self) -> int:
        return self.sp.unk_id()

    @property
    def pad_id(self) -> int:
        """The pad piece; EOS for a model trained without one (sentencepiece's default)."""
        pad = self.sp.pad_id()
        return pad if pad >= 0 else self.eos_id

    @property
    def special_tokens(self) -> dict[str, str]:
        """{"bos_token": "<s>", ...} for the roles this model has (tokenizer_config.json)."""
        roles = {
            "bos": self.bos_id,
            "eos": self.eos_id,
            "pad": self.sp.pad_id(),
            "unk": self.unk_id,
        }
        return {f"{r}_token": self.sp.IdToPiece(i) for r, i in roles.items() if i >= 0}

    @property
    def fingerprint(self) -> str:
        return fingerprint(self)

    def encode(self, text: str) -> list[int]:
        return self.encode_batch([text])[0]

    def encode_batch(self, texts: list[str], num_threads: int = -1) -> list[list[int]]:
        """`encode` of each text; sentencepiece spreads them over `num_threads` (-1: all cores)."""
        out = self.sp.Encode(texts, num_threads=num_threads)
        for i, text in enumerate(texts):
            if _META in text:
                out[i] = self._encode_meta(text)
        return out

    def _encode_meta(self, text: str) -> list[int]:
        # sentencepiece writes spaces as U+2581 and decodes every U+2581 back to a space, so
        # a literal one would come back as a space: encode it as its UTF-8 byte pieces instead.
        meta = [self.sp.PieceToId(f"<0x{b:02X}>") for b in _META.encode()]
        if self.unk_id in meta:  # a model without byte pieces: do as sentencepiece does
            return self.sp.EncodeAsIds(text)
        ids = []
        for k, part in enumerate(self.sp.EncodeAsIds(text.split(_META))):
            ids += (meta if k else []) + part
        return ids

    def decode(self, ids) -> str:
        return self.sp.DecodeIds([int(i) for i in ids])

    @staticmethod
    def train(
        inputs: list[str],
        model_prefix: str | os.PathLike,
        vocab_size: int,
        model_type: str = "bpe",
        json_key: str = "text",
    ) -> Path:
        """Train on text files (or JSONL, see `iter_documents`); write and return PREFIX.model.

        Training sees lines (sentencepiece's unit) with their newline kept; the model is
        written aside and renamed, and no `.vocab` file is left beside it.
        """

        def lines() -> Iterator[str]:
            for doc in iter_documents(inputs, json_key):
                yield from doc.splitlines(keepends=True)

        out = Path(f"{model_prefix}.model")
        proto = sp_train.train_proto(lines(), vocab_size, model_type)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(out.name + f".tmp{os.getpid()}")
        tmp.write_bytes(proto)
        os.replace(tmp, out)
        return out


# ---- Hugging Face tokenizers -------------------------------------------------------------------

HF_FILE = "tokenizer.json"
# tokenizer.json does not say which special token ends a document (transformers keeps that in
# tokenizer_config.json, which megalite does not store): the usual names of the families in use,
# first match wins. Reading tokenizer.json alone means a checkpoint's copy of it gives the same ids.
_SPECIAL_NAMES = {
    "eos": ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "[EOS]"),
    "bos": ("<|begin_of_text|>", "<s>", "<bos>", "<|startoftext|>", "[BOS]"),
    "pad": ("<pad>", "<|pad|>", "<|padding|>", "[PAD]"),
    "unk": ("<unk>", "<|unk|>", "[UNK]"),
}


def _import_tokenizers():
    try:
        import tokenizers  # optional: only Hugging Face tokenizers need it
    except ImportError:
        raise MegaliteError(
            "Hugging Face tokenizers need the tokenizers package; pip install tokenizers "
            "(or megalite[hf])"
        ) from None
    return tokenizers


class HFTokenizer:
    """A Hugging Face `tokenizers` tokenizer.json with the interface of `Tokenizer`.

    `path` is the tokenizer.json or a directory holding one (what `save_pretrained` writes);
    `model_path` is always the file, the one a checkpoint copies. Text is encoded as text:
    no BOS/EOS added (preprocessing appends EOS, as with sentencepiece) and a literal special
    token such as "<|endoftext|>" inside a document is encoded as its characters, never as the
    control id, so only megalite's EOS ends a document and byte-level BPE round-trips any text.
    """

    kind = HUGGINGFACE
    file_name = HF_FILE

    def __init__(self, path: str | os.PathLike):
        path = Path(path)
        file = path / HF_FILE if path.is_dir() else path
        if path.is_dir() and not file.is_file():
            raise MegaliteError(
                f"directory {path} holds no {HF_FILE}; save a fast tokenizer there with "
                "save_pretrained, or pass the tokenizer.json or a sentencepiece .model"
            )
        if not file.is_file():
            raise MegaliteError(
                f"tokenizer {file} does not exist; pass a Hugging Face tokenizer.json (or a "
                "directory holding one) to --tokenizer-model"
            )
        self.model_path = str(file)
        tokenizers = _import_tokenizers()
        try:
            self.tok = tokenizers.Tokenizer.from_file(self.model_path)
        except Exception as e:  # tokenizers raises its own exception type for bad files
            first = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise MegaliteError(
                f"{file} is not a Hugging Face tokenizer.json ({first}); pass the file written "
                "by tokenizers' save() or save_pretrained"
            ) from None
        self.tok.encode_special_tokens = True  # see the class docstring
        # GPT-2's BPE from vocab.json + merges.txt (or a checkpoint's copy of it): GPT-2's split
        self._words = gpt2_bpe.WordEncoder(self.tok) if gpt2_bpe.is_gpt2_bpe(self.tok) else None
        vocab = self.tok.get_vocab(with_added_tokens=True)
        # ids may leave gaps (added tokens past the model's vocabulary): size by the largest
        self._vocab_size = max(vocab.values(), default=-1) + 1
        specials = {
            t.content: i for i, t in self.tok.get_added_tokens_decoder().items() if t.special
        }

        def find(role, pool):
            return next(((n, pool[n]) for n in _SPECIAL_NAMES[role] if n in pool), (None, -1))

        self._eos = find("eos", specials)
        # GPT-2's convention: <|endoftext|> both starts and ends text
        self._bos = find("bos", specials)
        if self._bos[0] is None and self._eos[0] == "<|endoftext|>":
            self._bos = self._eos
        self._pad = find("pad", specials)
        self._unk = find("unk", vocab)  # byte-level BPE has none: every byte is a token

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def bos_id(self) -> int:
        return self._bos[1]

    @property
    def eos_id(self) -> int:
        return self._eos[1]

    @property
    def unk_id(self) -> int:
        return self._unk[1]

    @property
    def pad_id(self) -> int:
        """The pad token; EOS for a tokenizer without one (as `Tokenizer.pad_id`)."""
        return self._pad[1] if self._pad[0] is not None else self.eos_id

    @property
    def special_tokens(self) -> dict[str, str]:
        """{"bos_token": "<s>", ...} for the roles this tokenizer has (tokenizer_config.json)."""
        roles = {"bos": self._bos, "eos": self._eos, "pad": self._pad, "unk": self._unk}
        return {f"{r}_token": name for r, (name, _) in roles.items() if name is not None}

    @property
    def fingerprint(self) -> str:
        return fingerprint(self)

    def encode(self, text: str) -> list[int]:
        if self._words is not None:
            return self._words.encode_batch([text])[0]
        return self.tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str], num_threads: int = -1) -> list[list[int]]:
        """`encode` of each text. num_threads=1 encodes in this thread (worker processes);
        otherwise tokenizers' own thread pool (all cores, or RAYON_NUM_THREADS) does. GPT-2's
        BPE always encodes in this thread (its split is Python's `regex`): use worker processes."""
        if self._words is not None:
            return self._words.encode_batch(texts)
        if num_threads == 1:
            return [self.encode(t) for t in texts]
        return [e.ids for e in self.tok.encode_batch_fast(texts, add_special_tokens=False)]

    def decode(self, ids) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=True)


def tokenizer_kind(path: str | os.PathLike | None, kind: str | None = None) -> str:
    """'sentencepiece', 'huggingface' or 'GPT2BPETokenizer': `kind` (Megatron's names accepted)
    or, when None, from the path: a directory or a .json file is Hugging Face, a .model file
    sentencepiece."""
    if kind is not None:
        if kind not in KINDS:
            raise MegaliteError(
                f"unknown tokenizer type {kind!r}; use sentencepiece or huggingface (Megatron's "
                "GPTSentencePieceTokenizer, SentencePieceTokenizer, HuggingFaceTokenizer and "
                "GPT2BPETokenizer work too)"
            )
        return KINDS[kind]
    if path is None:
        raise MegaliteError(
            "no tokenizer given; pass --tokenizer-model (or --tokenizer-type GPT2BPETokenizer "
            "with --vocab-file and --merge-file)"
        )
    p = Path(path)
    if p.is_dir() or p.suffix == ".json":
        return HUGGINGFACE
    if p.suffix == ".model":
        return SENTENCEPIECE
    if not p.exists():
        raise MegaliteError(
            f"tokenizer model {p} does not exist; pass a sentencepiece .model, a Hugging Face "
            "tokenizer.json or a directory holding one to --tokenizer-model"
        )
    raise MegaliteError(
        f"cannot tell which kind of tokenizer {p} is (neither a .model file, a .json file nor a "
        "directory); rename it or pass --tokenizer-type sentencepiece|huggingface"
    )


def load_tokenizer(
    path: str | os.PathLike | None,
    kind: str | None = None,
    vocab_file: str | os.PathLike | None = None,
    merge_file: str | os.PathLike | None = None,
) -> Tokenizer | HFTokenizer:
    """The tokenizer at `path`, of `kind` (see `tokenizer_kind`): a `Tokenizer` or an
    `HFTokenizer`, which have the same interface. `vocab_file` and `merge_file` (GPT-2's
    vocab.json and merges.txt) make GPT-2's BPE, an `HFTokenizer`; `kind` may then be omitted
    or GPT2BPETokenizer, and `path` must be."""
    files = vocab_file is not None or merge_file is not None
    if kind is None and path is None and files:
        kind = GPT2BPE
    which = tokenizer_kind(path, kind)
    if which == GPT2BPE:
        if path is not None:
            raise MegaliteError(
                "GPT2BPETokenizer reads --vocab-file and --merge-file, not --tokenizer-model; "
                "drop --tokenizer-model (or pass --tokenizer-type HuggingFaceTokenizer)"
            )
        return HFTokenizer(gpt2_bpe.tokenizer_json(vocab_file, merge_file))
    if files:
        raise MegaliteError(
            "--vocab-file and --merge-file make GPT-2's BPE: pass --tokenizer-type "
            "GPT2BPETokenizer and no --tokenizer-model"
        )
    cls = {SENTENCEPIECE: Tokenizer, HUGGINGFACE: HFTokenizer}[which]
    return cls(path)
