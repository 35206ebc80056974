"""The server as OpenAI's clients use it: the `openai` package (a completion, streamed ones, a
streamed chat completion, the model list), and lm-evaluation-harness's `local-completions`
scoring a small local task (log-likelihood and generation) exactly as its `hf` backend scores
the same model exported to transformers. A random GPT-2 with a sentencepiece tokenizer, served
in fp64 from a thread of this process (the layouts: tests/e2e/test_serve.py)."""

import json
import shutil
import threading

import pytest

from tests.e2e.conftest import ROOT

pytestmark = pytest.mark.slow
openai = pytest.importorskip("openai")
pytest.importorskip("transformers")

TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n"
            "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}")  # fmt: skip


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(server, base url, exported HF dir): the model converted HF -> megalite -> HF, the
    megalite checkpoint served."""
    from megalite.cli import generate as gen_tool
    from megalite.cli import serve as serve_tool
    from tests.unit.test_checkpoint_hf import convert, hf_model
    from tests.unit.test_generation import train_tokenizer

    d = tmp_path_factory.mktemp("openai")
    hf_model("gpt2", seed=2).save_pretrained(d / "hf", safe_serialization=True)
    shutil.copy(train_tokenizer(d), d / "hf" / "tokenizer.model")
    convert.main([str(d / "hf"), str(d / "ml"), "--to", "megalite"])
    convert.main([str(d / "ml"), str(d / "export"), "--to", "hf"])
    model = gen_tool.load_at_layout(gen_tool.open_checkpoint(d / "ml"), dtype="fp64")
    server = serve_tool.Server(model, port=0, model_id="tiny", chat_template=TEMPLATE)
    thread = threading.Thread(target=server.serve)
    thread.start()
    yield server, f"http://127.0.0.1:{server.port}/v1", d / "export"
    server.stop()
    thread.join(timeout=60)


def test_openai_client_completions_streamed_and_chat(served):
    server, url, _ = served
    tok = server.model.tok
    client = openai.OpenAI(base_url=url, api_key="none", max_retries=0)
    assert [m.id for m in client.models.list()] == ["tiny"]
    kw = {"model": "tiny", "prompt": "def f(x):", "max_tokens": 8, "temperature": 0}
    whole = client.completions.create(**kw, logprobs=2)
    c = whole.choices[0]
    assert whole.model == "tiny" and len(c.logprobs.tokens) == whole.usage.completion_tokens
    chunks = list(client.completions.create(**kw, stream=True))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == c.text
    assert chunks[-1].choices[0].finish_reason == c.finish_reason
    # n = 2 samples of two prompts, streamed: choice i * n + j, each as it is alone
    many = client.completions.create(model="tiny", prompt=["def f(x):", "import"], n=2,
                                     max_tokens=5, temperature=0, stream=True)  # fmt: skip
    texts = {}
    for ch in many:
        for x in ch.choices:
            texts[x.index] = texts.get(x.index, "") + x.text
    alone = client.completions.create(model="tiny", prompt="import", max_tokens=5, temperature=0)
    assert texts == {0: c.text[: len(texts[0])], 1: texts[0], 2: alone.choices[0].text,
                     3: alone.choices[0].text}  # fmt: skip
    # chat: the template rendered (its BOS text as the BOS id), streamed as it is whole
    msgs = [{"role": "user", "content": "def f(x):"}]
    chat = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=6,
                                          temperature=0)  # fmt: skip
    ids = [tok.bos_id] + tok.encode("user: def f(x):\nassistant:")
    same = client.completions.create(model="tiny", prompt=ids, max_tokens=6, temperature=0)
    assert chat.choices[0].message.content == same.choices[0].text
    assert chat.usage.prompt_tokens == len(ids)
    scored = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=6,
                                            temperature=0, logprobs=True, top_logprobs=2)  # fmt: skip
    lp = client.completions.create(model="tiny", prompt=ids, max_tokens=6, temperature=0,
                                   logprobs=2).choices[0].logprobs  # fmt: skip
    content = scored.choices[0].logprobs.content
    assert [c.logprob for c in content] == lp.token_logprobs
    assert [c.token for c in content] == lp.tokens
    assert all(len(c.top_logprobs) == 2 for c in content)
    parts = list(client.chat.completions.create(model="tiny", messages=msgs, max_tokens=6,
                                                temperature=0, stream=True))  # fmt: skip
    assert parts[0].choices[0].delta.role == "assistant"
    assert "".join(p.choices[0].delta.content or "" for p in parts) == same.choices[0].text
    with pytest.raises(openai.NotFoundError, match="does not exist") as e:
        client.completions.create(model="other", prompt="a", max_tokens=1)
    assert (e.value.code, e.value.param) == ("model_not_found", "model")
    with pytest.raises(openai.BadRequestError, match="'logprobs' has a bad value") as e:
        client.completions.create(model="tiny", prompt="a", logprobs=99)
    assert (e.value.type, e.value.param) == ("invalid_request_error", "logprobs")


def _lm_eval(tmp_path, model, model_args):
    import lm_eval
    from lm_eval.tasks import TaskManager

    tasks = tmp_path / "tasks"
    tasks.mkdir(exist_ok=True)
    src = ROOT / "tests" / "lm_eval"
    for name in ("tiny_mc.yaml", "tiny_gen.yaml"):
        text = (src / name).read_text().replace("DATA", str(src / "tiny.jsonl"))
        (tasks / name).write_text(text)
    manager = TaskManager(include_path=str(tasks), include_defaults=False)
    out = lm_eval.simple_evaluate(model=model, model_args=model_args, task_manager=manager,
                                  tasks=["megalite_tiny_mc", "megalite_tiny_gen"],
                                  log_samples=True, batch_size=2)  # fmt: skip
    samples = {t: [s["resps"] for s in sorted(ss, key=lambda s: s["doc_id"])]
               for t, ss in out["samples"].items()}  # fmt: skip
    results = {t: {k: v for k, v in r.items() if k != "alias"} for t, r in out["results"].items()}
    return results, samples


def assert_lm_eval_matches_hf(url, export, tmp_path, monkeypatch):
    """lm-eval's local-completions against the server at `url` (.../v1) scores the local task
    as its hf backend scores `export` (the served model in transformers, fp64)."""
    pytest.importorskip("lm_eval")
    for var in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(var, "1")  # nothing from the network: local data and tokenizer
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    api = _lm_eval(tmp_path, "local-completions",
                   f"model=tiny,base_url={url}/completions,tokenizer_backend=huggingface,"
                   f"tokenizer={export},max_length=32,max_retries=1")  # fmt: skip
    hf = _lm_eval(tmp_path, "hf", f"pretrained={export},dtype=float64,device=cpu,max_length=32")
    assert api[0] == hf[0]  # the scores
    (a, h) = api[1], hf[1]
    assert a["megalite_tiny_gen"] == h["megalite_tiny_gen"]  # each generated text
    for doc_a, doc_h in zip(a["megalite_tiny_mc"], h["megalite_tiny_mc"], strict=True):
        for choice_a, choice_h in zip(doc_a, doc_h, strict=True):  # [(logprob, is_greedy)]
            (lp_a, greedy_a), (lp_h, greedy_h) = choice_a[0], choice_h[0]
            assert lp_a == pytest.approx(lp_h, abs=1e-9) and greedy_a == greedy_h
    assert json.dumps(a["megalite_tiny_gen"]) != json.dumps([[[""]]] * 4)  # text was made


def test_lm_eval_local_completions_scores_equal_its_hf_backend(served, tmp_path, monkeypatch):
    _, url, export = served
    assert_lm_eval_matches_hf(url, export, tmp_path, monkeypatch)
