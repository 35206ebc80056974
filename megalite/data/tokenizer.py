"""Tokenizers: sentencepiece (round-trips any text; trained here) and Hugging Face `tokenizers`.

`load_tokenizer(path, kind)` opens either; both classes have the same interface (`encode`,
`encode_batch`, `decode`, `vocab_size`, `bos_id`, `eos_id`, `unk_id`, `pad_id`, `model_path`,
`kind`, `file_name`), so callers never ask which one they hold.
"""

import io
import os
import re
from collections.abc import Iterator
from pathlib import Path

import sentencepiece as spm

from megalite.data.corpus import iter_documents
from megalite.errors import MegaliteError

# Options chosen so decode(encode(text)) == text for source code and any other text:
# no normalisation, spaces kept as they are (indentation is content; runs of spaces may form
# pieces of their own), no dummy leading space, newlines and tabs as pieces, and UTF-8 byte
# pieces for characters the vocabulary lacks (never <unk>).
_ROUND_TRIP = dict(
    normalization_rule_name="identity",
    remove_extra_whitespaces=False,
    add_dummy_prefix=False,
    allow_whitespace_only_pieces=True,
    user_defined_symbols=["\n", "\t"],
    byte_fallback=True,
    split_digits=True,
)
_META = "\u2581"  # sentencepiece's whitespace symbol
SPECIAL_IDS = dict(unk_id=0, bos_id=1, eos_id=2, pad_id=3)
# Training reads at most this many lines, sampled over the whole input: enough for a
# vocabulary of a few thousand pieces, and it bounds time and memory on large inputs.
INPUT_SENTENCE_SIZE = 300_000

SENTENCEPIECE, HUGGINGFACE = "sentencepiece", "huggingface"
# Megatron-LM's --tokenizer-type names are accepted too, so its command lines carry over.
KINDS = {
    SENTENCEPIECE: SENTENCEPIECE,
    "GPTSentencePieceTokenizer": SENTENCEPIECE,
    HUGGINGFACE: HUGGINGFACE,
    "HuggingFaceTokenizer": HUGGINGFACE,
}


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
        proto = _train_proto(lines(), vocab_size, model_type)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(out.name + f".tmp{os.getpid()}")
        tmp.write_bytes(proto)
        os.replace(tmp, out)
        return out


def _train_proto(sentences: Iterator[str], vocab_size: int, model_type: str) -> bytes:
    model = io.BytesIO()
    failed = []

    def guarded():
        # sentencepiece turns an exception raised by the iterator into a RuntimeError that
        # names only a line of code: keep the original (e.g. a MegaliteError about the input).
        try:
            yield from sentences
        except Exception as e:
            failed.append(e)
            raise

    # The sampling of input lines is random: a fixed seed makes the same input give the same model.
    spm.set_random_generator_seed(1)
    try:
        spm.SentencePieceTrainer.Train(
            sentence_iterator=guarded(),
            model_writer=model,
            vocab_size=vocab_size,
            model_type=model_type,
            input_sentence_size=INPUT_SENTENCE_SIZE,
            shuffle_input_sentence=True,
            max_sentence_length=16384,  # bytes; longer lines are left out of training only
            character_coverage=0.9995,  # rare characters become byte pieces
            num_threads=os.cpu_count() or 1,
            minloglevel=2,
            **SPECIAL_IDS,
            **_ROUND_TRIP,
        )
    except RuntimeError as e:
        if failed:
            raise failed[0] from None
        raise MegaliteError(_explain(str(e), vocab_size)) from None
    return model.getvalue()


def _explain(error: str, vocab_size: int) -> str:
    """sentencepiece's training error as one actionable sentence."""
    if m := re.search(
        r"Vocabulary size too high \(\d+\)\. Please set it to a value <= (\d+)", error
    ):
        return (
            f"--vocab-size {vocab_size} is more than this input supports ({m[1]} pieces); "
            "lower it or give more text"
        )
    if m := re.search(r"smaller than required_chars\. \d+ vs (\d+)", error):
        return (
            f"--vocab-size {vocab_size} is too small: this input needs at least {m[1]} pieces "
            "(256 byte pieces, specials and its characters); raise it"
        )
    last = error.strip().splitlines()[-1]
    return f"sentencepiece could not train a {vocab_size}-piece tokenizer ({last}); check the input"


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

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str], num_threads: int = -1) -> list[list[int]]:
        """`encode` of each text. num_threads=1 encodes in this thread (worker processes);
        otherwise tokenizers' own thread pool (all cores, or RAYON_NUM_THREADS) does."""
        if num_threads == 1:
            return [self.encode(t) for t in texts]
        return [e.ids for e in self.tok.encode_batch_fast(texts, add_special_tokens=False)]

    def decode(self, ids) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=True)


def tokenizer_kind(path: str | os.PathLike, kind: str | None = None) -> str:
    """'sentencepiece' or 'huggingface': `kind` (Megatron's names accepted) or, when None, from
    the path: a directory or a .json file is Hugging Face, a .model file sentencepiece."""
    if kind is not None:
        if kind not in KINDS:
            raise MegaliteError(
                f"unknown tokenizer type {kind!r}; use sentencepiece or huggingface (Megatron's "
                "GPTSentencePieceTokenizer and HuggingFaceTokenizer work too)"
            )
        return KINDS[kind]
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


def load_tokenizer(path: str | os.PathLike, kind: str | None = None) -> Tokenizer | HFTokenizer:
    """The tokenizer at `path`, of `kind` (see `tokenizer_kind`): a `Tokenizer` or an
    `HFTokenizer`, which have the same interface."""
    cls = {SENTENCEPIECE: Tokenizer, HUGGINGFACE: HFTokenizer}[tokenizer_kind(path, kind)]
    return cls(path)
