"""Nothing chosen silently when a run continues a model (issue 54).

A tiny random Llama converted from Hugging Face (vocabulary 512, 64 positions, token ids 5/6,
a generation config) is trained one step at --seq-length 32 and exported back: the export keeps
the model's context, token ids and generation config. A run continuing that checkpoint with
--data-path and no --tokenizer-model uses the tokenizer the checkpoint carries (and says so);
without --data-path it trains on the built-in corpus with that tokenizer, and says so. A
vocabulary mismatch names where each size came from; a model whose vocabulary is not the demo
tokenizer's, with no tokenizer of its own (an HF import without one, a Megatron checkpoint), is
refused on the built-in corpus.
"""

import json
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from safetensors import safe_open

from megalite.checkpoint import format as fmt
from megalite.checkpoint.hf_random import write_random_hf
from tests.e2e.conftest import ROOT, TINY, pretrain, train_byte_bpe

pytestmark = pytest.mark.slow

CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 512,
          "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
          "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "bos_token_id": 5,
          "eos_token_id": 6}  # fmt: skip
GENERATION = {"bos_token_id": 5, "eos_token_id": [6, 7], "temperature": 0.7}
# the batch and schedule: the model is the checkpoint's (no model flag); no warmup in 1-2 steps
RUN = [*TINY[6:], "--lr-warmup-iters", "0"]
assert RUN[0] == "--seq-length"


def convert(*args):
    from megalite.cli import convert as cli

    cli.main([str(a) for a in args])


def run(args, tmp: Path):
    """pretrain_gpt.py in one process, not checked: the completed process."""
    env = {**__import__("os").environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "pretrain_gpt.py", *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600, env=env)  # fmt: skip


@pytest.fixture(scope="module")
def continued(tiny_data, tmp_path_factory):
    """The converted model trained one step on tiny_data at --seq-length 32, saved."""
    tmp = tmp_path_factory.mktemp("continued")
    prefix, model = tiny_data
    src = write_random_hf(tmp / "src", CONFIG)
    (src / "generation_config.json").write_text(json.dumps(GENERATION))
    convert(src, tmp / "ml", "--to", "megalite")
    args = [*RUN, "--load", tmp / "ml", "--data-path", prefix, "--tokenizer-model", model,
            "--train-iters", "1", "--save", tmp / "ck"]  # fmt: skip
    pretrain(1, [str(a) for a in args], tmp)
    return tmp


def test_export_keeps_what_the_model_said(continued, tmp_path):
    ck = fmt.Checkpoint(continued / "ck")
    assert ck.model_config["seq_length"] == 32  # the run's
    assert {t["dtype"] for t in ck.tensors.values()} == {"float32"}  # the run's weights
    # directly, and through Megatron-LM (torch_dist) and back
    convert(continued / "ck", tmp_path / "mt", "--to", "megatron")
    convert(tmp_path / "mt", tmp_path / "back", "--to", "megalite")
    for src in ("ck", "back"):
        hf = tmp_path / f"hf-{src}"
        convert(continued / src if src == "ck" else tmp_path / src, hf, "--to", "hf")
        config = json.loads((hf / "config.json").read_text())
        assert config["max_position_embeddings"] == 64, src  # the model's
        assert (config["bos_token_id"], config["eos_token_id"]) == (5, 6)
        assert json.loads((hf / "generation_config.json").read_text()) == GENERATION
        # the source's dtype (write_random_hf's bfloat16), the weights written in it
        assert config["torch_dtype"] == "bfloat16", src
        with safe_open(hf / "model.safetensors", "pt") as f:
            assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}, src


def test_data_without_tokenizer_uses_the_checkpoints(continued, tiny_data, tmp_path):
    prefix, _ = tiny_data
    args = [*RUN, "--load", continued / "ck", "--data-path", prefix, "--train-iters", "2",
            "--metrics-file", tmp_path / "m.jsonl"]  # fmt: skip
    r = run(args, tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"tokenizer: checkpoint {continued / 'ck'}" in r.stdout
    assert [json.loads(x)["iteration"] for x in open(tmp_path / "m.jsonl")] == [2]


def test_a_vocabulary_mismatch_names_its_sources(continued, tiny_data, tmp_path):
    prefix, _ = tiny_data
    lib = Path(sysconfig.get_paths()["stdlib"])
    texts = [(lib / n).read_text() for n in ("json/decoder.py", "textwrap.py", "argparse.py")]
    big = train_byte_bpe(texts, tmp_path / "big", 600)
    args = [*RUN, "--load", continued / "ck", "--data-path", prefix, "--tokenizer-model", big,
            "--train-iters", "2"]  # fmt: skip
    r = run(args, tmp_path)
    assert r.returncode != 0
    (line,) = r.stderr.strip().splitlines()
    assert "(--tokenizer-model) has 600 pieces" in line and "vocabulary of 512" in line, line
    assert "--vocab-size" not in line, line  # a flag the user did not give
    # the size given in a YAML file: named by its file and field
    (tmp_path / "run.yaml").write_text("model:\n  vocab_size: 512\n")
    r = run([*args, "--config", tmp_path / "run.yaml"], tmp_path)
    assert r.returncode != 0
    (line,) = r.stderr.strip().splitlines()
    assert "600 pieces" in line and f"model.vocab_size in {tmp_path / 'run.yaml'}" in line, line
    assert "--vocab-size" not in line, line


def test_the_builtin_corpus_is_named_and_uses_the_models_tokenizer(continued, tmp_path):
    args = [*RUN, "--load", continued / "ck", "--train-iters", "2", "--data-cache-dir",
            tmp_path / "cache"]  # fmt: skip
    r = run(args, tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    (line,) = [x for x in r.stdout.splitlines() if x.startswith("data: ")]
    assert "built-in demo corpus" in line and "the checkpoint's tokenizer" in line, line


def test_a_model_of_another_vocabulary_is_refused_on_the_builtin_corpus(tmp_path):
    src = write_random_hf(tmp_path / "src", {**CONFIG, "vocab_size": 4096})
    convert(src, tmp_path / "ml", "--to", "megalite")
    convert(tmp_path / "ml", tmp_path / "mt", "--to", "megatron")  # --load reads it as it is
    for ckpt in ("ml", "mt"):
        r = run([*RUN, "--load", tmp_path / ckpt, "--train-iters", "1"], tmp_path)
        assert r.returncode != 0
        (line,) = r.stderr.strip().splitlines()
        assert "vocabulary of 4096" in line and "holds no tokenizer" in line, line
        assert "--data-path" in line and "--tokenizer-model" in line
