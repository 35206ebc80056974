"""tools/convert_checkpoint.py and tools/generate.py on a checkpoint written by pretrain_gpt.py.

A Llama-flavoured model trained at tp=2 (two shard files) is exported to Hugging Face: the
transformers model and tokenizer load it and agree with megalite on logits and greedy tokens.
"""

import json
import subprocess
import sys

import pytest
import torch

from megalite.checkpoint import format as fmt
from tests.e2e.conftest import ROOT, TINY, pretrain

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
transformers = pytest.importorskip("transformers")


def _tool(*args, check=True):
    r = subprocess.run(
        [sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    if check:
        assert r.returncode == 0, r.stderr[-3000:]
    return r


@pytest.fixture(scope="module")
def trained(tiny_data, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("convert")
    prefix, model = tiny_data
    args = [*TINY, "--data-path", prefix, "--tokenizer-model", model, "--train-iters", "3",
            "--flavour", "llama", "--tp", "2", "--save", str(tmp / "run")]  # fmt: skip
    pretrain(2, args, tmp)
    return tmp / "run"


def test_export_to_hf_matches(trained, tmp_path):
    hf_dir = tmp_path / "hf"
    r = _tool("tools/convert_checkpoint.py", str(trained), str(hf_dir), "--to", "hf")
    assert r.stderr.count("\n") == 1  # no progress bar off a terminal (tqdm), one line
    assert {"config.json", "model.safetensors", "tokenizer.model"} <= {
        p.name for p in hf_dir.iterdir()
    }
    m = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    assert type(m).__name__ == "LlamaForCausalLM"
    tok = transformers.AutoTokenizer.from_pretrained(hf_dir)
    prompt = "def encode(self, o):\n    "
    out = json.loads(_tool("tools/generate.py", "--load", str(trained), "--prompt", prompt,
                           "--max-new-tokens", "10", "--greedy", "--json").stdout)  # fmt: skip
    assert tok.encode(prompt) == out["prompt_ids"]  # the same tokenizer, through transformers
    ids = torch.tensor([out["prompt_ids"]])
    hf_new = m.generate(ids, max_new_tokens=10, do_sample=False, pad_token_id=tok.pad_token_id or 0)
    assert hf_new[0, ids.shape[1] :].tolist() == out["new_ids"]

    # logits of the whole model read from the two-file checkpoint, in this process
    sys.path.insert(0, str(ROOT / "tools"))
    from generate import load

    chunk, _ = load(trained)
    x = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (chunk(x) - m(x).logits).abs().max() <= 1e-4
    assert len(fmt.Checkpoint(trained).index["tensors"]["layers.0.mlp.up.weight"]["shards"]) == 2


def test_cli_errors_are_one_line(tmp_path):
    (tmp_path / "bert").mkdir()
    (tmp_path / "bert" / "config.json").write_text(json.dumps({"architectures": ["BertModel"]}))
    r = _tool("tools/convert_checkpoint.py", str(tmp_path / "bert"), str(tmp_path / "o"), "--to",
              "megalite", check=False)  # fmt: skip
    assert r.returncode == 2 and r.stderr.count("\n") == 1
    assert "'BertModel' is not supported" in r.stderr


def test_megatron_round_trip_of_a_trained_run(trained, tmp_path):
    """A run trained at tp=2 -> Megatron legacy at tp=2 pp=2 and torch_dist -> megalite: the same
    weights; the tool says the optimizer state is not converted."""
    want = fmt.Checkpoint(trained)
    for form, layout in (("legacy", ["--tp", "2", "--pp", "2"]), ("torch_dist", [])):
        mt, back = tmp_path / f"mt_{form}", tmp_path / f"ml_{form}"
        r = _tool("tools/convert_checkpoint.py", str(trained), str(mt), "--to", "megatron",
                  "--format", form, *layout)  # fmt: skip
        assert "optimizer state is not converted" in r.stderr
        _tool("tools/convert_checkpoint.py", str(mt), str(back), "--from", "megatron", "--to",
              "megalite")  # fmt: skip
        got = fmt.Checkpoint(back)
        assert sorted(got.names()) == sorted(want.names())
        assert all(torch.equal(got.read(n), want.read(n)) for n in want.names())
    assert sorted(p.name for p in (tmp_path / "mt_legacy/iter_0000003").iterdir()) == [
        "mp_rank_00_000", "mp_rank_00_001", "mp_rank_01_000", "mp_rank_01_001"]  # fmt: skip


def test_megatron_missing_rank_is_one_line(trained, tmp_path):
    mt = tmp_path / "mt"
    _tool("tools/convert_checkpoint.py", str(trained), str(mt), "--to", "megatron", "--format",
          "legacy", "--tp", "2")  # fmt: skip
    for f in (mt / "iter_0000003/mp_rank_01").iterdir():
        f.unlink()
    (mt / "iter_0000003/mp_rank_01").rmdir()
    r = _tool("tools/convert_checkpoint.py", str(mt), str(tmp_path / "o"), "--to", "megalite",
              check=False)  # fmt: skip
    assert r.returncode == 2 and r.stderr.count("\n") == 1
    assert "lacks mp_rank_01/model_optim_rng.pt" in r.stderr and not (tmp_path / "o").exists()
