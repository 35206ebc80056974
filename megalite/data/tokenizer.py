"""A sentencepiece tokenizer that round-trips any text, and its training."""

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


class Tokenizer:
    """A sentencepiece model: `encode`/`decode` and the ids of its special pieces."""

    def __init__(self, model_path: str | os.PathLike):
        self.model_path = str(model_path)
        if not os.path.isfile(self.model_path):
            raise MegaliteError(
                f"tokenizer model {self.model_path} does not exist; pass a sentencepiece .model "
                "to --tokenizer-model"
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
