"""A Megatron-LM run moved to megalite: trained on at another layout from its checkpoint.

megatron-core saves a Llama-style GPTModel at tp=2 (tests/megatron_oracle.py, legacy layout
with its optimizer state); `megalite-convert --from megatron` imports it and pretrain_gpt.py
continues from it with only --load, the data and the tokenizer (the architecture comes from
the Megatron args), at tp=1 pp=2 under torchrun: the loss is finite and step for step the
loss of a one-process run from the same checkpoint. The trained checkpoint, exported back to a
legacy Megatron checkpoint at tp=2, loads into megatron-core with megalite's logits.
"""

import math
import subprocess
import sys

import pytest

from tests import megatron_oracle as mo
from tests.e2e.conftest import ROOT, pretrain

pytest.importorskip("megatron.core")
pytestmark = [pytest.mark.slow, pytest.mark.distributed]

# megalite-convert with every `megatron` module made unimportable
NO_MEGATRON = """
import sys
sys.modules["megatron"] = None
from megalite.cli import convert
convert.main(sys.argv[1:])
"""
TRAIN = ["--micro-batch-size", "1", "--global-batch-size", "4", "--lr", "3e-3",
         "--lr-warmup-iters", "1", "--eval-interval", "0", "--log-interval", "1",
         "--wandb-mode", "disabled", "--train-iters", "3"]  # fmt: skip


def test_megatron_checkpoint_trains_on_at_another_layout_and_goes_back(tiny_data, tmp_path, capsys):
    from megalite.cli import convert

    arch, layout = mo.LLAMA, mo.Layout(tp=2)  # vocabulary 600: the corpus's 512 pieces fit
    x = mo.tokens(arch)
    (before,) = mo.run(mo.save_ranks, [(arch, layout, str(tmp_path / "mt"), x, 0)])
    # the converter in a clean process: Megatron's pickles read without megatron importable
    r = subprocess.run([sys.executable, "-c", NO_MEGATRON, str(tmp_path / "mt" / "legacy"),
                        str(tmp_path / "ml"), "--to", "megalite"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "optimizer state is not converted" in r.stderr  # Megatron's AdamW state was there
    prefix, model = tiny_data
    data = ["--data-path", prefix, "--tokenizer-model", model, "--load", str(tmp_path / "ml")]
    one, _ = pretrain(1, [*TRAIN, *data], tmp_path)
    two, _ = pretrain(2, [*TRAIN, *data, "--pp", "2", "--save", str(tmp_path / "run")], tmp_path)
    assert [r["iteration"] for r in one] == [r["iteration"] for r in two] == [1, 2, 3]
    assert all(math.isfinite(r["loss"]) for r in one), one
    assert [r["loss"] for r in two] == pytest.approx([r["loss"] for r in one], rel=1e-4)

    # ... and back to the Megatron job's layout: megatron-core loads the trained weights
    out = tmp_path / "back"
    convert.main([str(tmp_path / "run"), str(out), "--to", "megatron", "--format", "legacy",
                  "--tp", "2"])  # fmt: skip
    (theirs,) = mo.run(mo.load_ranks, [(arch, layout, str(out), "legacy", x)])
    ours = mo.megalite_logits(tmp_path / "run", x)
    v = arch.vocab
    assert (theirs[..., :v] - ours[..., :v]).abs().max() <= 1e-5
    assert (theirs[..., :v] - before[..., :v]).abs().max() > 1e-3  # three steps moved them
