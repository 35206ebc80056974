"""Training a sentencepiece model (`Tokenizer.train`): the options that make it round-trip any
text, and sentencepiece's training errors as one actionable sentence."""

import io
import os
import re
from collections.abc import Iterator

import sentencepiece as spm

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
SPECIAL_IDS = dict(unk_id=0, bos_id=1, eos_id=2, pad_id=3)
# Training reads at most this many lines, sampled over the whole input: enough for a
# vocabulary of a few thousand pieces, and it bounds time and memory on large inputs.
INPUT_SENTENCE_SIZE = 300_000


def train_proto(sentences: Iterator[str], vocab_size: int, model_type: str) -> bytes:
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
