"""DeepSeek-V3's e_score_correction_bias is megalite's expert bias: imported, exported and
through checkpoints (converted at tp2 pp2, loaded back in one process) it is kept exactly, and
the logits are transformers' with a bias large enough to change the choice of experts."""

import pytest
import torch

from megalite.checkpoint import format as fmt
from megalite.checkpoint import hf
from megalite.checkpoint.regions import load_model
from megalite.model.gpt import GPTChunk
from megalite.parallel.groups import single_process_groups
from tests.unit.test_mla import IDS, hf_deepseek, imported

transformers = pytest.importorskip("transformers")
BIAS = "model.layers.1.mlp.gate.e_score_correction_bias"  # layer 0 is dense


def _biased():
    m = hf_deepseek("moe")
    with torch.no_grad():  # sigmoid scores lie in (0, 1): a bias of this size reorders them
        m.model.layers[1].mlp.gate.e_score_correction_bias.copy_(
            torch.randn(8, generator=torch.Generator().manual_seed(3))
        )
    return m


def test_the_bias_is_imported_and_changes_the_logits():
    m = _biased()
    chunk = imported(m)
    bias = chunk.layers["1"].mlp.expert_bias
    assert torch.equal(bias, m.state_dict()[BIAS].float())
    with torch.no_grad():
        theirs = m(IDS).logits
        assert (chunk(IDS) - theirs).abs().max() <= 1e-5
        bias.zero_()  # what the import gave before: another choice of experts
        assert (chunk(IDS) - theirs).abs().max() > 1e-3


def test_export_writes_the_bias_back():
    m = _biased()
    cfg = hf.model_config_from_hf(m.config.to_dict())
    state = hf.from_hf(m.state_dict(), cfg)
    assert torch.equal(state["layers.1.mlp.expert_bias"], m.state_dict()[BIAS])
    assert torch.equal(hf.to_hf(state, cfg)[BIAS], m.state_dict()[BIAS])


def test_conversion_through_checkpoints_keeps_the_bias(tmp_path):
    from tests.unit.test_checkpoint_hf import assert_round_trip_exact, convert

    m = _biased()
    m.save_pretrained(tmp_path / "hf", safe_serialization=True)
    convert.main([str(tmp_path / "hf"), str(tmp_path / "ml"), "--to", "megalite", "--tp", "2",
                  "--pp", "2"])  # fmt: skip
    ck = fmt.Checkpoint(tmp_path / "ml")
    assert torch.equal(ck.read("layers.1.mlp.expert_bias"), m.state_dict()[BIAS])
    cfg = hf.model_config_from_hf(m.config.to_dict())
    chunk = GPTChunk(cfg).eval()
    assert load_model([chunk], single_process_groups().tp, ck) == []
    with torch.no_grad():
        assert (chunk(IDS) - m(IDS).logits).abs().max() <= 1e-5
    assert_round_trip_exact(m, tmp_path / "ml", tmp_path / "out")
