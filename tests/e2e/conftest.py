"""End-to-end fixtures: a tiny tokenised corpus, and pretrain_gpt.py run under torchrun."""

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

TINY = [
    "--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
    "--micro-batch-size", "1", "--global-batch-size", "8", "--lr", "3e-3", "--lr-warmup-iters", "2",
    "--eval-interval", "0", "--log-interval", "1", "--wandb-mode", "disabled",
]  # fmt: skip


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory):
    """A few standard-library modules tokenised with a 512-piece tokenizer: (prefix, model)."""
    d = tmp_path_factory.mktemp("data")
    lib = Path(sysconfig.get_paths()["stdlib"])
    text = d / "text"
    text.mkdir()
    for name in (
        "json/encoder.py",
        "json/decoder.py",
        "textwrap.py",
        "heapq.py",
        "bisect.py",
        "copy.py",
    ):
        (text / name.replace("/", "_")).write_text((lib / name).read_text())
    prefix = d / "tiny"
    subprocess.run(
        [sys.executable, "tools/preprocess_data.py", "--input", str(text), "--output-prefix", str(prefix),
         "--train-tokenizer", "--vocab-size", "512", "--workers", "1", "--quiet"],
        cwd=ROOT, check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    return str(prefix), str(prefix) + ".model"


@pytest.fixture(scope="session")
def one_process_curve(tiny_data, tmp_path_factory) -> list[float]:
    """The losses of TINY on tiny_data for 20 steps in one process (fp32, no FP8): the curve
    test_layouts holds every layout to, and test_fp8_layouts' FP8 curves must differ from."""
    prefix, model = tiny_data
    args = [*TINY, "--data-path", prefix, "--tokenizer-model", model, "--train-iters", "20"]
    rows, _ = pretrain(1, args, tmp_path_factory.mktemp("one-process"))
    return [r["loss"] for r in rows]


def pretrain(nproc: int, args: list[str], tmp: Path, timeout: int = 600, check: bool = True):
    """Run pretrain_gpt.py on nproc CPU ranks; returns (metrics rows, completed process)."""
    metrics = tmp / f"metrics-{len(list(tmp.glob('metrics-*')))}.jsonl"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
           "--standalone", "pretrain_gpt.py", *args, "--metrics-file", str(metrics)]  # fmt: skip
    if nproc == 1:
        cmd = [sys.executable, "pretrain_gpt.py", *args, "--metrics-file", str(metrics)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)
    if check and r.returncode != 0:
        raise AssertionError(
            f"pretrain_gpt.py failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-5000:]}"
        )
    rows = (
        [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    )
    return rows, r


def train_byte_bpe(texts: list[str], out: Path, vocab_size: int) -> Path:
    """A GPT-2-style byte-level BPE (special token <|endoftext|>) trained on `texts` with the
    tokenizers package, saved as out/tokenizer.json; returns the file."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte: nothing is unknown
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    return out / "tokenizer.json"
