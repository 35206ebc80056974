"""tools/preprocess_data.py off a terminal (a SLURM log): progress lines reach the file; and
Megatron's offline GPT-2 command line (with --legacy-tokenizer) is taken as it is."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from megalite.cli.preprocess import parse_args
from megalite.data import corpus
from megalite.errors import MegaliteError

pytest.importorskip("tokenizers")
pytest.importorskip("regex")
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """A JSONL of standard-library files and a small GPT-2-style vocab.json + merges.txt."""
    from tokenizers.implementations import ByteLevelBPETokenizer

    d = tmp_path_factory.mktemp("progress")
    texts = [f.read_text(encoding="utf-8") for f in corpus.stdlib_files(max_bytes=1_300_000)]
    (d / "in.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(texts[:5], vocab_size=300, special_tokens=["<|endoftext|>"])
    bpe.save_model(str(d))
    return d, len(texts)


def _run(d, *extra):
    """Megatron's offline GPT-2 command, stderr to a file as under a batch scheduler."""
    cmd = [sys.executable, str(REPO / "tools" / "preprocess_data.py"), "--input",
           str(d / "in.jsonl"), "--output-prefix", str(d / "out"), "--tokenizer-type",
           "GPT2BPETokenizer", "--vocab-file", str(d / "vocab.json"), "--merge-file",
           str(d / "merges.txt"), "--append-eod", "--workers", "1", "--legacy-tokenizer",
           *extra]  # fmt: skip
    env = {**os.environ, "MEGALITE_CACHE": str(d / "cache")}
    with open(d / "log.txt", "w") as log:
        r = subprocess.run(cmd, stderr=log, stdout=subprocess.DEVNULL, env=env, timeout=300)
    return r.returncode, (d / "log.txt").read_text()


def test_progress_lines_reach_a_log_file(inputs):
    d, ndocs = inputs
    rc, log = _run(d, "--log-interval", "1")
    assert rc == 0, log
    lines = [line for line in log.splitlines() if line.startswith("processed ")]
    assert len(lines) >= 3, log
    pat = r"processed ([\d,]+) documents, [\d,]+ tokens, [\d.]+ MB in \S+: [\d,]+ tokens/s, "
    pat += r"[\d.]+ MB/s, ETA \d+m\d\ds"
    assert all(re.fullmatch(pat, line) for line in lines[:-1]), lines
    counts = [int(re.match(r"processed ([\d,]+)", x)[1].replace(",", "")) for x in lines]
    assert counts == sorted(counts) and counts[-1] <= ndocs
    assert "\r" not in log  # no bar in a file
    assert f"{ndocs} documents" in log.splitlines()[-1]  # the final line


def test_quiet_writes_no_progress(inputs):
    d, _ = inputs
    rc, log = _run(d, "--log-interval", "1", "--quiet")
    assert rc == 0 and "processed " not in log and len(log.splitlines()) == 1, log


def test_bad_log_interval_is_one_line(inputs):
    d, _ = inputs
    rc, log = _run(d, "--log-interval", "0")
    assert rc != 0 and log.strip().splitlines() == [log.strip()], log
    assert "--log-interval 0 must be at least 1" in log


def test_legacy_tokenizer_only_with_gpt2():
    # Megatron's legacy wrappers of the other types add ids megalite does not write
    argv = ["--input", "x.jsonl", "--output-prefix", "o", "--append-eod", "--legacy-tokenizer"]
    for kind in ("SentencePieceTokenizer", "HuggingFaceTokenizer"):
        with pytest.raises(MegaliteError, match="--legacy-tokenizer is taken with GPT2BPE"):
            parse_args([*argv, "--tokenizer-type", kind, "--tokenizer-model", "t.model"])
