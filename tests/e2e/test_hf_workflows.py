"""The workflows users bring from Hugging Face: a tokenizer.json from preprocessing through
training to the exported model, and TensorBoard beside the metrics file.

One tiny run (a byte-level BPE saved with save_pretrained, --tensorboard-dir, --save) serves
every test here.
"""

import json
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from megalite.checkpoint import format as fmt
from megalite.data.indexed_dataset import IndexedDataset
from megalite.data.tokenizer import load_tokenizer
from tests.e2e.conftest import ROOT, TINY, pretrain, train_byte_bpe

pytestmark = pytest.mark.slow
transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
pytest.importorskip("tensorboard")

SAMPLE = "def encode(self, o):\n    return  '<|endoftext|>' + ünïcödé\t🙂\n"


def _tool(*args):
    r = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True,
                       timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    return r


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hf_run")
    lib = Path(sysconfig.get_paths()["stdlib"])
    docs = [
        (lib / n).read_text() for n in ("json/encoder.py", "textwrap.py", "heapq.py", "copy.py")
    ]
    with open(tmp / "docs.jsonl", "w") as fh:
        fh.writelines(json.dumps({"text": d}) + "\n" for d in docs)
    # the way users have it: a fast tokenizer saved by transformers (tokenizer.json + configs)
    file = train_byte_bpe(docs, tmp / "trained", 384)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_file=str(file))
    fast.save_pretrained(tmp / "hf_tok")
    _tool("tools/preprocess_data.py", "--input", str(tmp / "docs.jsonl"), "--output-prefix",
          str(tmp / "data"), "--tokenizer-model", str(tmp / "hf_tok"), "--workers", "1")  # fmt: skip
    args = [*TINY, "--data-path", str(tmp / "data"), "--tokenizer-model", str(tmp / "hf_tok"),
            "--tokenizer-type", "HuggingFaceTokenizer", "--train-iters", "3", "--split", "100,0,0",
            "--save", str(tmp / "ckpt"), "--tensorboard-dir", str(tmp / "tb")]  # fmt: skip
    rows, _ = pretrain(1, args, tmp)
    return tmp, rows


def test_hf_tokenizer_trains_and_exports(run, tmp_path):
    tmp, rows = run
    assert [r["iteration"] for r in rows] == [1, 2, 3]
    ckpt = fmt.Checkpoint(tmp / "ckpt")
    assert fmt.stored_tokenizer(ckpt.files) == "tokenizer.json" and fmt.TOKENIZER not in ckpt.files
    assert ckpt.files["tokenizer.json"]["sha256"] == fmt.sha256_file(
        tmp / "hf_tok" / "tokenizer.json"
    )

    r = _tool("tools/convert_checkpoint.py", str(tmp / "ckpt"), str(tmp_path / "hf"), "--to", "hf")
    assert r.stderr.count("\n") == 1  # "wrote ...": no progress bars off a terminal
    files = {p.name for p in (tmp_path / "hf").iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= files
    assert "tokenizer.model" not in files

    ours = transformers.AutoTokenizer.from_pretrained(tmp / "hf_tok")  # what the run read
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")  # what it exported
    megalite_tok = load_tokenizer(ckpt.dir / "tokenizer.json")  # what it trained on
    ids = megalite_tok.encode(SAMPLE)
    assert theirs.encode(SAMPLE) == ids  # no BOS added, the literal <|endoftext|> is text
    assert ours.encode(SAMPLE, split_special_tokens=True) == ids
    assert theirs.decode(ids) == SAMPLE == megalite_tok.decode(ids)
    # the corpus as trained on: the exported tokenizer gives the dataset's tokens, and they
    # decode to the documents byte for byte
    data = IndexedDataset(tmp / "data")
    docs = [json.loads(line)["text"] for line in open(tmp / "docs.jsonl")]
    for i, doc in enumerate(docs):
        tokens = data.document(i).tolist()
        assert tokens[-1] == megalite_tok.eos_id and theirs.encode(doc) == tokens[:-1]
        assert megalite_tok.decode(tokens) == doc
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    eos = megalite_tok.eos_id
    assert config["eos_token_id"] == config["bos_token_id"] == eos == theirs.eos_token_id
    assert config["vocab_size"] == 384  # the weights themselves: tests/e2e/test_convert.py


def test_tensorboard_holds_the_logged_losses(run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tmp, rows = run
    assert list((tmp / "tb").glob("events.out.tfevents.*"))
    acc = EventAccumulator(str(tmp / "tb")).Reload()
    loss = acc.Scalars("loss")
    assert [e.step for e in loss] == [r["iteration"] for r in rows]
    # event files hold float32
    assert [e.value for e in loss] == pytest.approx([r["loss"] for r in rows], rel=1e-6)
    assert {"grad_norm", "lr", "tokens_per_s"} <= set(acc.Tags()["scalars"])
