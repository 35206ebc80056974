"""Generation in one process (megalite/generation.py, tools/generate.py, tools/serve.py).

Random HF GPT-2 and Llama models (tests/unit/test_checkpoint_hf.py) converted to megalite and run
in fp64, so no near-tie can decide a token: the KV cache gives transformers' greedy tokens, the
cache is used (one token fed per step, where the no-cache loop feeds the whole context), batched
prompts of different lengths give what each gives alone, and the sharded sampling helpers at
tp=1 pick what plain whole-vocabulary code picks. The layouts are in
tests/distributed/test_generation.py.
"""

import json
import sysconfig
import threading
import urllib.request
from pathlib import Path

import pytest
import torch

from megalite.checkpoint import format as fmt
from megalite.checkpoint.checkpointer import load_model
from megalite.config_read import from_dict
from megalite.data.tokenizer import Tokenizer
from megalite.errors import MegaliteError, run_main
from megalite.generation import generate, generate_scored
from megalite.model.env import LOCAL, LayerEnv
from megalite.model.gpt import GPTChunk
from megalite.parallel.groups import single_process_groups
from megalite.parallel.sampling import (
    Sampling,
    _argmax,
    _draw,
    _kth_largest,
    _nucleus_floor,
    _softmax,
)

transformers = pytest.importorskip("transformers")
from tests.unit.test_checkpoint_hf import SEQ, VOCAB, _tool, convert, hf_greedy, hf_model  # noqa: E402

gen_tool, serve_tool = _tool("generate"), _tool("serve")
GROUPS = single_process_groups()


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models: a second thread only adds waits (seconds per test on a loaded machine)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


PROMPTS = [[5, 6, 7, 8, 9], [42], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]]
NEW = 10


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def pair(request, tmp_path_factory):
    """(HF model in fp64, megalite chunk in fp64, megalite checkpoint dir)."""
    d = tmp_path_factory.mktemp(request.param)
    m = hf_model(request.param, seed=1)
    m.save_pretrained(d / "hf", safe_serialization=True)
    convert.main([str(d / "hf"), str(d / "ml"), "--to", "megalite"])
    ckpt = fmt.Checkpoint(d / "ml")
    chunk = GPTChunk(from_dict({"model": ckpt.model_config}).model, LayerEnv(dtype=torch.float64))
    load_model([chunk], LOCAL, ckpt)
    return m.double(), chunk.eval(), d / "ml"


def _fed(chunk, fn):
    """fn()'s result and the number of tokens each forward fed to the first layer."""
    fed = []
    h = chunk.layers["0"].register_forward_pre_hook(lambda m, a: fed.append(a[0].shape[1]))
    try:
        return fn(), fed
    finally:
        h.remove()


def test_greedy_with_the_cache_equals_transformers(pair):
    m, chunk, _ = pair
    alone = [generate([chunk], GROUPS, [p], NEW)[0] for p in PROMPTS]
    assert alone == [hf_greedy(m, p, NEW) for p in PROMPTS]
    # left-padded into one batch, each prompt gives what it gives alone
    assert generate([chunk], GROUPS, PROMPTS, NEW) == alone


def test_the_cache_feeds_one_token_per_step(pair):
    _, chunk, _ = pair
    cached, fed = _fed(chunk, lambda: generate([chunk], GROUPS, PROMPTS[:1], NEW))
    assert fed == [5] + [1] * (NEW - 1)
    again, fed = _fed(chunk, lambda: generate([chunk], GROUPS, PROMPTS[:1], NEW, use_cache=False))
    assert fed == list(range(5, 5 + NEW)) and again == cached


def test_sampling_is_seeded_and_narrows_to_greedy(pair):
    _, chunk, _ = pair
    greedy = generate([chunk], GROUPS, PROMPTS, NEW)

    def sampled(s, seed=1):
        return generate([chunk], GROUPS, PROMPTS, NEW, s, torch.Generator().manual_seed(seed))

    s = Sampling(temperature=0.8, top_k=50, top_p=0.9)
    assert sampled(s) == sampled(s) != sampled(s, seed=2)
    assert sampled(Sampling(1.5)) != greedy
    assert sampled(Sampling(1.0, top_k=1)) == greedy
    assert sampled(Sampling(1.0, top_p=1e-9)) == greedy


def test_one_host_read_per_new_token(pair):
    from megalite import testing as host_syncs

    _, chunk, _ = pair
    for sampling in (Sampling(), Sampling(temperature=0.8, top_k=40, top_p=0.9)):
        counter = host_syncs.HostSyncCounter()
        with counter.counting():
            generate([chunk], GROUPS, PROMPTS, NEW, sampling)
        assert counter.count == NEW, [what for what, _ in counter.where]


def test_stops_at_eos_a_stop_condition_and_the_context(pair):
    _, chunk, _ = pair
    greedy = generate([chunk], GROUPS, PROMPTS, NEW)
    eos = greedy[0][3]
    cut = greedy[0].index(eos) + 1
    out = generate([chunk], GROUPS, PROMPTS, NEW, eos_id=eos)
    assert out[0] == greedy[0][:cut]  # EOS kept, the row ends; the others go on
    for row, full in zip(out[1:], greedy[1:]):
        assert row == full[: full.index(eos) + 1] if eos in full else row == full
    out = generate([chunk], GROUPS, PROMPTS, NEW, stop=lambda ids: len(ids) == 2)
    assert out == [g[:2] for g in greedy]
    # a full context: a prompt of SEQ tokens still gets its one next token, not more
    assert len(generate([chunk], GROUPS, [[7] * SEQ], NEW)[0]) == 1
    assert len(generate([chunk], GROUPS, [[7] * (SEQ - 4)], NEW)[0]) == 5
    with pytest.raises(MegaliteError, match="has 33 tokens but the model's context is 32"):
        generate([chunk], GROUPS, [[7] * (SEQ + 1)], NEW)


def _whole(chunk, ids):
    """log_softmax of a whole-sequence forward (no cache): (len(ids), vocab)."""
    with torch.no_grad():
        return torch.log_softmax(chunk(torch.tensor([ids])), -1)[0]


def test_scores_are_the_whole_forward_log_softmax(pair):
    _, chunk, _ = pair
    k = 3
    r = generate_scored([chunk], GROUPS, PROMPTS, NEW, logprobs=k, echo=True)
    assert r.tokens == generate([chunk], GROUPS, PROMPTS, NEW)
    for p, new, lp, top, plp, ptop in zip(PROMPTS, r.tokens, r.logprobs, r.top,
                                          r.prompt_logprobs, r.prompt_top):  # fmt: skip
        ids = p + new
        ref = _whole(chunk, ids)
        want = [ref[i - 1, ids[i]].item() for i in range(1, len(ids))]
        assert len(plp) == len(p) - 1 and len(lp) == len(new)
        torch.testing.assert_close(plp + lp, want, rtol=0, atol=1e-10)
        best = ref[:-1].topk(k, -1)
        for (row_ids, row_lp), (i, v) in zip([zip(*t) for t in ptop + top],
                                             zip(best.indices.tolist(), best.values.tolist())):  # fmt: skip
            assert list(row_ids) == i
            torch.testing.assert_close(list(row_lp), v, rtol=0, atol=1e-10)
    # max_new_tokens 0 with echo: the prompts' scores alone (lm-eval's log-likelihood request)
    only = generate_scored([chunk], GROUPS, PROMPTS, 0, logprobs=0, echo=True)
    assert only.tokens == [[], [], []] and only.logprobs == [[], [], []]
    assert only.prompt_logprobs == [[v for v in row] for row in r.prompt_logprobs]
    assert only.prompt_top == [[[]] * (len(p) - 1) for p in PROMPTS]


def test_sharded_sampling_helpers_pick_what_the_whole_vocabulary_does():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 97, generator=g, dtype=torch.float64)
    logits[1, [3, 50]] = logits[1].max() + 1  # a tie: the first index wins, as argmax
    logits[2] = 0.0  # flat
    assert torch.equal(_argmax(logits, 0, LOCAL), logits.argmax(-1))
    for k in (1, 5, 97, 500):
        ref = logits.topk(min(k, 97), -1).values[:, -1:]
        assert torch.equal(_kth_largest(logits, k, LOCAL), ref)
    probs = _softmax(logits, LOCAL)
    assert torch.allclose(probs, logits.softmax(-1), rtol=1e-12, atol=0)
    # the reference: a token stays while the strictly likelier ones hold less than p (tied
    # tokens stay or go together, whatever order a sort would put them in)
    likelier = (probs[:, None, :] * (probs[:, None, :] > probs[:, :, None])).sum(-1)
    for p in (1e-9, 0.1, 0.5, 0.9, 0.999999):
        kept = probs >= _nucleus_floor(probs, p, LOCAL)
        assert torch.equal(kept, likelier < p), p
    tiny = probs >= _nucleus_floor(probs, 1e-9, LOCAL)  # the likeliest, with its ties
    assert tiny[2].all() and tiny[1].nonzero()[:, 0].tolist() == [3, 50]
    u = torch.rand(6, generator=g, dtype=torch.float64)
    masked = probs * ((probs > 0.011) | (probs == probs.max(-1, keepdim=True).values))
    ref = torch.searchsorted(masked.cumsum(-1), (u * masked.sum(-1))[:, None], right=True)[:, 0]
    assert torch.equal(_draw(masked, u, 0, LOCAL), ref)
    assert torch.equal(_draw(masked, torch.ones(6, dtype=torch.float64), 0, LOCAL),
                       96 - (masked > 0).flip(-1).long().argmax(-1))  # fmt: skip


# ---- the tools: bad input, the CLI and the server -------------------------------------------


def train_tokenizer(d: Path) -> str:
    """A 500-piece sentencepiece model (the vocabulary of the HF test models), in d."""
    lib = Path(sysconfig.get_paths()["stdlib"])
    path = Tokenizer.train([str(lib / "textwrap.py"), str(lib / "heapq.py")], d / "t", VOCAB)
    assert Tokenizer(path).vocab_size == VOCAB
    return str(path)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return train_tokenizer(tmp_path_factory.mktemp("tok"))


def _fail(capsys, argv, match):
    with pytest.raises(SystemExit) as e:
        run_main(gen_tool.main, argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and err[0].startswith("megalite: error: ")
    assert match in err[0], err[0]


def test_generate_tool_prints_and_refuses_bad_input(pair, tokenizer, tmp_path, capsys):
    _, chunk, ml = pair
    base = ["--load", str(ml), "--tokenizer-model", tokenizer, "--max-new-tokens", "6"]
    gen_tool.main([*base, "--prompt", "def f(x):", "--prompt", "a", "--greedy", "--json"])
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["new_ids"] for r in rows] == generate(
        [chunk], GROUPS, [r["prompt_ids"] for r in rows], 6
    )
    _fail(capsys, [*base, "--prompt", "x = 1\n" * 40], "but the model's context is 32")
    _fail(capsys, [*base[:3], str(tmp_path / "none.model")], "does not exist")
    lib = Path(sysconfig.get_paths()["stdlib"])
    other = Tokenizer.train([str(lib / "textwrap.py")], tmp_path / "other", 400)
    _fail(capsys, [*base[:3], str(other)], "has 400 pieces but the model")


def test_server_answers_and_shuts_down(pair, tokenizer):
    _, chunk, ml = pair
    model = gen_tool.load_at_layout(gen_tool.open_checkpoint(ml, tokenizer), dtype="fp64")
    server = serve_tool.Server(model, port=0)
    thread = threading.Thread(target=server.serve)
    thread.start()
    url = f"http://127.0.0.1:{server.port}"

    def call(method, path, body):
        req = urllib.request.Request(url + path, json.dumps(body).encode(), method=method)
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    try:
        status, out = call("POST", "/v1/completions",
                           {"prompt": "def f(x):", "max_tokens": 5, "temperature": 0})  # fmt: skip
        ids = model.tok.encode("def f(x):")
        want = model.tok.decode(generate([chunk], GROUPS, [ids], 5)[0])
        assert status == 200 and out["choices"][0]["text"] == want
        assert out["usage"]["prompt_tokens"] == len(ids)
        status, out = call("PUT", "/api", {"prompts": ["def f(x):"], "tokens_to_generate": 5,
                                           "temperature": 0.0})  # fmt: skip
        assert status == 200 and out["text"] == ["def f(x):" + want]
        status, out = call("PUT", "/api", {"prompts": ["a"], "top_k": "many"})
        assert status == 400 and "'top_k' must be int" in out["error"]
        _openai_requests(call, model, chunk, url)
    finally:
        server.stop()
        thread.join(timeout=30)
    assert not thread.is_alive()


def _openai_requests(call, model, chunk, url):
    """The OpenAI fields (tests/e2e/test_openai_api.py runs the clients): echo and logprobs
    against generate_scored, stop strings streamed, token-id batches with n, errors' shape."""
    tok = model.tok
    ids = tok.encode("def f(x):")
    ref = generate_scored([chunk], GROUPS, [ids], 5, logprobs=2, echo=True)
    status, out = call("POST", "/v1/completions", {"prompt": "def f(x):", "max_tokens": 5,
                                                   "temperature": 0, "logprobs": 2, "echo": True})  # fmt: skip
    lp = out["choices"][0]["logprobs"]
    assert status == 200 and out["model"] == "megalite"
    assert lp["token_logprobs"] == [None, *ref.prompt_logprobs[0], *ref.logprobs[0]]
    assert (
        "".join(lp["tokens"])
        == out["choices"][0]["text"]
        == "def f(x):" + tok.decode(ref.tokens[0])
    )
    assert lp["text_offset"] == [sum(map(len, lp["tokens"][:i])) for i in range(len(ids) + 5)]
    top = lp["top_logprobs"][len(ids)]  # the first new token's: its 2 likeliest (one is it)
    assert len(top) == 2 and max(top.values()) == lp["token_logprobs"][len(ids)]
    # lm-eval's log-likelihood request: ids, max_tokens 0 with echo (or 1: one token more)
    status, out = call("POST", "/v1/completions", {"prompt": [ids, ids[:3]], "max_tokens": 0,
                                                   "logprobs": 1, "echo": True})  # fmt: skip
    assert [c["logprobs"]["token_logprobs"] for c in out["choices"]] == [
        [None, *ref.prompt_logprobs[0]], [None, *ref.prompt_logprobs[0][:2]]]  # fmt: skip
    # n = 2 of two token-id prompts: choice i * n + j
    status, out = call("POST", "/v1/completions", {"prompt": [ids, ids[:3]], "max_tokens": 3,
                                                   "n": 2, "temperature": 0})  # fmt: skip
    short = tok.decode(generate([chunk], GROUPS, [ids[:3]], 3)[0])
    want = [tok.decode(ref.tokens[0][:3])] * 2 + [short] * 2
    assert [c["text"] for c in out["choices"]] == want and out["usage"]["completion_tokens"] == 12
    # a stop string: the text ends before it, streamed or not
    text = tok.decode(ref.tokens[0])
    stop = text[2:4]
    body = {"prompt": "def f(x):", "max_tokens": 5, "temperature": 0, "stop": [stop]}
    status, out = call("POST", "/v1/completions", body)
    assert out["choices"][0]["text"] == text[: text.index(stop)]
    assert out["choices"][0]["finish_reason"] == "stop"
    streamed = {**body, "stream": True, "stream_options": {"include_usage": True}}
    req = urllib.request.Request(url + "/v1/completions", json.dumps(streamed).encode(),
                                 method="POST")  # fmt: skip
    with urllib.request.urlopen(req, timeout=60) as r:
        events = r.read().decode().split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""] and r.headers["Content-Type"] == "text/event-stream"
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
    *chunks, last = chunks  # the usage chunk: no choices
    assert last["choices"] == [] and last["usage"] == out["usage"]
    assert "".join(c["choices"][0]["text"] for c in chunks) == out["choices"][0]["text"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    # errors: OpenAI's shape and status
    status, out = call("POST", "/v1/completions", {"prompt": [tok.vocab_size + 3]})
    assert status == 400 and out["error"]["param"] == "prompt"
    assert set(out["error"]) == {"message", "type", "param", "code"}
    assert "outside the vocabulary" in out["error"]["message"]
    status, out = call("POST", "/v1/completions", {"prompt": "a", "presence_penalty": 0.5})
    assert status == 400 and out["error"]["param"] == "presence_penalty"
    status, out = call("POST", "/v1/nope", {})
    assert status == 404 and out["error"]["code"] == "unknown_url"
    with urllib.request.urlopen(url + "/v1/models", timeout=60) as r:
        assert [m["id"] for m in json.loads(r.read())["data"]] == ["megalite"]
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(url + "/other", timeout=60)
    assert e.value.code == 404 and json.loads(e.value.read())["error"]["code"] == "unknown_url"


def test_chat_template_is_found_rendered_and_its_special_tokens_encoded(tokenizer, tmp_path):
    from megalite.cli.openai_api import ChatTemplate, encode_with_specials, find_chat_template

    assert find_chat_template(None, [tmp_path]) is None
    conf = {"chat_template": [{"name": "tool_use", "template": "x"},
                              {"name": "default", "template": "{{ bos_token }}{{ messages[0]['content'] }}"}]}  # fmt: skip
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(conf))
    source = find_chat_template(None, [tmp_path / "none", tmp_path])
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0]['content'] }}!")
    assert find_chat_template(None, [tmp_path]) == "{{ messages[0]['content'] }}!"  # .jinja first
    assert find_chat_template(str(tmp_path / "tokenizer_config.json"), []) == source
    with pytest.raises(FileNotFoundError, match="does not exist"):
        find_chat_template(str(tmp_path / "missing.jinja"), [tmp_path])
    tok = Tokenizer(tokenizer)
    text = ChatTemplate(source, tok.special_tokens).render([{"role": "user", "content": "def"}])
    assert text == "<s>def"
    assert encode_with_specials(tok, text) == [tok.bos_id, *tok.encode("def")]
    assert tok.encode(text) != encode_with_specials(tok, text)  # as plain text, <s> is 3 pieces
