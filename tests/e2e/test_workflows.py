"""Workflows users already have, end to end through pretrain_gpt.py:

- a random Hugging Face Llama converted to megalite continues training with only --load, the
  data and the tokenizer (the architecture comes from the checkpoint), exactly as the run with
  every model flag spelled out; a flag that contradicts the checkpoint is one line;
- --exit-duration-in-mins saves and exits 0, and the resubmitted job resumes bit-exactly.
"""

import json

import pytest

from megalite.checkpoint import format as fmt
from tests.e2e.conftest import TINY, pretrain

transformers = pytest.importorskip("transformers")
pytestmark = [pytest.mark.slow, pytest.mark.distributed]

# training flags only: no model flag (TINY's model flags are left out)
TRAIN = ["--micro-batch-size", "1", "--global-batch-size", "4", "--lr", "3e-3", "--lr-warmup-iters", "2",
         "--eval-interval", "0", "--log-interval", "1", "--wandb-mode", "disabled", "--train-iters", "10"]  # fmt: skip
LLAMA = ["--flavour", "llama", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
         "--num-query-groups", "2", "--ffn-hidden-size", "64", "--seq-length", "32", "--vocab-size", "600",
         "--norm-epsilon", "1e-06", "--rotary-base", "10000", "--untie-embeddings-and-output-weights"]  # fmt: skip


def test_converted_llama_trains_from_the_checkpoint_alone(tiny_data, tmp_path):
    import torch

    from megalite.cli import convert

    torch.manual_seed(0)
    c = transformers.LlamaConfig(
        vocab_size=600, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
        rms_norm_eps=1e-6, tie_word_embeddings=False,
    )  # fmt: skip
    transformers.LlamaForCausalLM(c).save_pretrained(tmp_path / "hf", safe_serialization=True)
    convert.main([str(tmp_path / "hf"), str(tmp_path / "ml"), "--to", "megalite"])
    prefix, model = tiny_data  # 512 pieces: within the model's 600
    data = ["--data-path", prefix, "--tokenizer-model", model, "--load", str(tmp_path / "ml")]
    bare, _ = pretrain(1, [*TRAIN, *data], tmp_path)
    spelled, _ = pretrain(1, [*TRAIN, *data, *LLAMA], tmp_path)
    assert [r["iteration"] for r in bare] == list(range(1, 11))
    assert [(r["loss"], r["grad_norm"]) for r in bare] == [
        (r["loss"], r["grad_norm"]) for r in spelled
    ]
    rows, r = pretrain(1, [*TRAIN, *data, "--hidden-size", "64"], tmp_path, check=False)
    assert r.returncode == 2 and not rows
    line = r.stderr.strip().splitlines()[-1]
    assert line.startswith("megalite: error: checkpoint ") and "hidden_size=32" in line, line
    assert "--hidden-size is 64" in line and "[600, 32] there, [600, 64]" in line, line


def test_exit_duration_saves_exits_0_and_resumes_exactly(tiny_data, tmp_path):
    prefix, model = tiny_data
    args = [*TINY, "--data-path", prefix, "--tokenizer-model", model, "--train-iters", "4",
            "--lr-decay-iters", "4"]  # fmt: skip
    ref, _ = pretrain(1, [*args, "--save", str(tmp_path / "ref")], tmp_path)
    save = ["--save", str(tmp_path / "run"), "--async-save"]
    first, r = pretrain(1, [*args, *save, "--exit-duration-in-mins", "1e-9"], tmp_path)
    assert r.returncode == 0 and [x["iteration"] for x in first] == [1]
    assert "trained for --exit-duration-in-mins 1e-09: saved iteration 1" in r.stdout, r.stdout
    assert fmt.Checkpoint(tmp_path / "run").iteration == 1
    rest, r = pretrain(1, [*args, *save], tmp_path)  # the resubmitted job
    assert [x["iteration"] for x in rest] == [2, 3, 4]
    assert [x["loss"] for x in first + rest] == [x["loss"] for x in ref]
    a, b = fmt.Checkpoint(tmp_path / "run"), fmt.Checkpoint(tmp_path / "ref")
    assert a.iteration == b.iteration == 4
    for name in a.tensors:
        assert a.read(name).equal(b.read(name)), name
    assert json.loads((tmp_path / "run" / "iter_0000004" / "index.json").read_text())["rng"]
