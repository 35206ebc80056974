"""Conversion between Hugging Face transformers and megalite checkpoints, in one process.

Random tiny GPT2LMHeadModel / LlamaForCausalLM models (vocabulary 500, so megalite pads it;
"nanogpt": a GPT-2 with the exact GELU and zero biases, which imports as the nanogpt flavour) go
through tools/convert_checkpoint.py; megalite must give the same logits and the same greedy
tokens. The sharded (tp=2 pp=2) load of the same checkpoints is in
tests/distributed/test_checkpoint.py.
"""

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from megalite.checkpoint import format as fmt
from megalite.checkpoint.checkpointer import load_model
from megalite.config_read import from_dict
from megalite.errors import MegaliteError
from megalite.model.env import LOCAL
from megalite.model.gpt import GPTChunk
from megalite.testing import perturbed

transformers = pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parents[2]
VOCAB, SEQ = 500, 32


def _tool(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


convert, generate = _tool("convert_checkpoint"), _tool("generate")


def hf_model(kind: str, seed: int = 0):
    torch.manual_seed(seed)
    if kind in ("gpt2", "nanogpt"):
        act = "gelu" if kind == "nanogpt" else "gelu_new"
        c = transformers.GPT2Config(
            vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=4,
            activation_function=act,
        )  # fmt: skip
        m = perturbed(transformers.GPT2LMHeadModel(c), 0.02)
        if kind == "nanogpt":  # nanoGPT's bias=False, in GPT-2's layout
            with torch.no_grad():
                for name, p in m.named_parameters():
                    if name.endswith(".bias"):
                        p.zero_()
        return m
    else:
        c = transformers.LlamaConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
            tie_word_embeddings=False,
        )  # fmt: skip
        m = transformers.LlamaForCausalLM(c)
    return perturbed(m, 0.02)


def megalite_model(path) -> GPTChunk:
    ckpt = fmt.Checkpoint(path)
    ckpt.verify()
    chunk = GPTChunk(from_dict({"model": ckpt.model_config}).model)
    load_model([chunk], LOCAL, ckpt)
    return chunk.eval()


def hf_greedy(m, ids, n):
    out = m.generate(
        torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    return out[0, len(ids) :].tolist()


@pytest.fixture(scope="module", params=["gpt2", "nanogpt", "llama"])
def converted(request, tmp_path_factory):
    """(HF model, HF dir, megalite dir converted at tp=2 pp=2)."""
    d = tmp_path_factory.mktemp(request.param)
    m = hf_model(request.param)
    m.save_pretrained(d / "hf", safe_serialization=True)
    convert.main([str(d / "hf"), str(d / "ml"), "--to", "megalite", "--tp", "2", "--pp", "2"])
    assert fmt.Checkpoint(d / "ml").model_config["flavour"] == request.param
    return m, d / "hf", d / "ml"


def test_hf_to_megalite_same_logits_and_greedy_tokens(converted):
    m, _, ml = converted
    chunk = megalite_model(ml)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, theirs = chunk(ids), m(ids).logits
    assert ours.shape == theirs.shape == (2, SEQ, VOCAB)
    assert (ours - theirs).abs().max() <= 1e-4
    prompt = ids[0, :5].tolist()
    assert generate.generate(chunk, prompt, 12) == hf_greedy(m, prompt, 12)


def test_sampling_is_seeded(converted):
    chunk = megalite_model(converted[2])
    kw = {"greedy": False, "temperature": 0.8, "top_k": 50, "top_p": 0.9}
    a = generate.generate(chunk, [1, 2, 3], 8, seed=1, **kw)
    assert a == generate.generate(chunk, [1, 2, 3], 8, seed=1, **kw)
    # top-k 1 and a tiny nucleus both leave only the likeliest token
    greedy = generate.generate(chunk, [1, 2, 3], 8)
    assert generate.generate(chunk, [1, 2, 3], 8, greedy=False, top_k=1, seed=2) == greedy
    assert generate.generate(chunk, [1, 2, 3], 8, greedy=False, top_p=1e-6, seed=3) == greedy


def test_weights_only_checkpoint_meta(converted):
    _, _, ml = converted
    ck = fmt.Checkpoint(ml)
    assert ck.iteration == 0 and ck.index["optimizer"] is None
    assert ck.shape("embedding.word.weight")[0] == VOCAB  # stored unpadded
    assert not ck.names(optimizer=True)


def test_round_trips_are_identical(converted, tmp_path):
    m, hf_dir, ml = converted
    assert_round_trip_exact(m, ml, tmp_path)


def assert_round_trip_exact(m, ml, tmp_path):
    """megalite -> HF -> megalite gives identical tensors, and the exported HF model is `m`."""
    convert.main([str(ml), str(tmp_path / "hf"), "--to", "hf"])
    convert.main([str(tmp_path / "hf"), str(tmp_path / "ml"), "--to", "megalite"])
    a, b = fmt.Checkpoint(ml), fmt.Checkpoint(tmp_path / "ml")
    assert sorted(a.names()) == sorted(b.names())
    for n in a.names():
        assert torch.equal(a.read(n), b.read(n)), n
    # and the exported HF model is the original one
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert type(again) is type(m)
    theirs = m.state_dict()
    for k, v in again.state_dict().items():
        assert torch.equal(v, theirs[k]), k


def test_megalite_to_megalite_is_a_verified_copy(converted, tmp_path):
    _, _, ml = converted
    convert.main([str(ml), str(tmp_path / "copy"), "--to", "megalite", "--tp", "2"])
    assert fmt.Checkpoint(tmp_path / "copy").index["tensors"] == fmt.Checkpoint(ml).index["tensors"]
    with pytest.raises(MegaliteError, match="not divisible by tp=3"):
        convert.main([str(ml), str(tmp_path / "bad"), "--to", "megalite", "--tp", "3"])
    assert not (tmp_path / "bad").exists()


def test_refuses_to_overwrite_without_force(converted, tmp_path):
    _, hf_dir, _ = converted
    dst = tmp_path / "out"
    dst.mkdir()
    (dst / "keep").write_text("precious")
    with pytest.raises(MegaliteError, match="exists; pass --force"):
        convert.main([str(hf_dir), str(dst), "--to", "megalite"])
    assert (dst / "keep").read_text() == "precious"
    convert.main([str(hf_dir), str(dst), "--to", "megalite", "--force"])
    assert fmt.Checkpoint(dst).iteration == 0


def test_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps({"architectures": ["BertForMaskedLM"], "model_type": "bert"})
    )
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(MegaliteError, match="'BertForMaskedLM' is not supported"):
        convert.main([str(tmp_path), str(tmp_path / "out"), "--to", "megalite"])


def test_an_import_is_read_as_features_and_matched_to_a_flavour():
    """config.json -> features -> the FLAVOURS row that has them; none has them: one line."""
    from megalite.checkpoint.hf import model_config_from_hf

    llama = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                     num_attention_heads=4, vocab_size=VOCAB).to_dict()  # fmt: skip
    assert model_config_from_hf(llama).flavour == "llama"
    gpt2 = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=4).to_dict()
    assert model_config_from_hf(gpt2).flavour == "gpt2"
    for bias, what in (("attention_bias", "qkv_bias=True, linear_bias=True"),
                       ("mlp_bias", "linear_bias=True")):  # fmt: skip
        with pytest.raises(MegaliteError, match=f"Llama models with {what} are not supported"):
            model_config_from_hf({**llama, bias: True})


def test_a_gpt2_with_exact_gelu_and_real_biases_is_refused(tmp_path):
    """The exact GELU reads as the bias-free nanogpt flavour: a bias that is not zero is
    refused in one line, never dropped."""
    hf_model("gpt2").save_pretrained(tmp_path / "hf", safe_serialization=True)
    c = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**c, "activation_function": "gelu"}))
    with pytest.raises(MegaliteError, match=r"ln_1.bias is not zero, but the nanogpt flavour"):
        convert.main([str(tmp_path / "hf"), str(tmp_path / "ml"), "--to", "megalite"])
    assert not (tmp_path / "ml").exists()


def test_pickle_weights_are_refused(tmp_path):
    transformers.GPT2Config(n_layer=1).save_pretrained(tmp_path)
    (tmp_path / "pytorch_model.bin").write_bytes(b"pickle")
    with pytest.raises(MegaliteError, match="never loads pickle"):
        convert.main([str(tmp_path), str(tmp_path / "out"), "--to", "megalite"])


def test_generate_needs_a_matching_tokenizer(converted, tmp_path):
    _, _, ml = converted
    with pytest.raises(MegaliteError, match="holds no tokenizer"):
        generate.load(ml)


def test_missing_source(tmp_path):
    with pytest.raises(MegaliteError, match="does not exist"):
        convert.main([str(tmp_path / "nope"), str(tmp_path / "out"), "--to", "hf"])
