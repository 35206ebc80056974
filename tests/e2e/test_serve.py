"""tools/generate.py and tools/serve.py under torchrun at tp=2: one printed answer, one served
request, a clean shutdown. The tokens must be the one-process generation's (fp64)."""

import json
import os
import shutil
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
import torch

from tests.e2e.conftest import ROOT

pytestmark = [pytest.mark.slow, pytest.mark.distributed]
transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """(checkpoint dir, tokenizer, one-process greedy ids of PROMPT): a random HF GPT-2."""
    from megalite.generation import generate, generate_scored
    from megalite.parallel.groups import single_process_groups
    from tests.unit.test_checkpoint_hf import convert, hf_model
    from tests.unit.test_generation import gen_tool, train_tokenizer

    d = tmp_path_factory.mktemp("serve")
    tok = train_tokenizer(d)
    hf_model("gpt2", seed=2).save_pretrained(d / "hf", safe_serialization=True)
    shutil.copy(tok, d / "hf" / "tokenizer.model")  # carried by the checkpoint, then exported
    convert.main([str(d / "hf"), str(d / "ml"), "--to", "megalite"])
    convert.main([str(d / "ml"), str(d / "export"), "--to", "hf"])
    chunk, t = gen_tool.load(d / "ml", tok)
    chunk = chunk.double()
    ids = t.encode(PROMPT)
    with torch.no_grad():
        new = generate([chunk], single_process_groups(), [ids], 6)[0]
        scored = generate_scored([chunk], single_process_groups(), [ids], 6, logprobs=2, echo=True)
    return str(d / "ml"), tok, ids, new, t.decode(new), scored


PROMPT = "def f(x):"


def _torchrun(tool, *args):
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone",
            f"tools/{tool}.py", *args]  # fmt: skip


def test_generate_and_serve_under_torchrun(model, tmp_path, monkeypatch):
    path, tok, ids, new, text, scored = model
    flags = ["--load", path, "--tokenizer-model", tok, "--tp", "2", "--dtype", "fp64"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run(
        _torchrun("generate", *flags, "--prompt", PROMPT, "--max-new-tokens", "6", "--greedy",
                  "--json"), cwd=ROOT, capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    (line,) = r.stdout.splitlines()  # printed once, by rank 0
    assert json.loads(line)["new_ids"] == new
    serve = _torchrun("serve", *flags, "--port", "0", "--served-model-name", "tiny")
    server = subprocess.Popen(serve, cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        first = server.stdout.readline()  # "serving on http://127.0.0.1:PORT (pid N: ...)"
        assert first.startswith("serving on "), (first, server.stderr.read()[-3000:])
        url, pid = first.split()[2], int(first.split("(pid ")[1].split(":")[0])
        body = json.dumps({"prompt": PROMPT, "max_tokens": 6, "temperature": 0}).encode()
        req = urllib.request.Request(url + "/v1/completions", body, method="POST")
        with urllib.request.urlopen(req, timeout=120) as resp:
            assert json.loads(resp.read())["choices"][0]["text"] == text
        # log-probabilities over the vocabulary shards of tp=2, the prompt's too (echo)
        body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "logprobs": 2, "echo": True}
        req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode())
        with urllib.request.urlopen(req, timeout=120) as resp:
            lp = json.loads(resp.read())["choices"][0]["logprobs"]
        want = [*scored.prompt_logprobs[0], *scored.logprobs[0]]
        assert lp["token_logprobs"][0] is None
        torch.testing.assert_close(lp["token_logprobs"][1:], want, rtol=0, atol=1e-10)
        # streamed: the chunks' texts joined are the text
        body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "stream": True}
        req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode())
        with urllib.request.urlopen(req, timeout=120) as resp:
            events = [e for e in resp.read().decode().split("\n\n") if e]
        assert events[-1] == "data: [DONE]"
        chunks = [json.loads(e.removeprefix("data: "))["choices"][0] for e in events[:-1]]
        assert "".join(c["text"] for c in chunks) == text
        # lm-eval against the tp=2 server scores as its hf backend on the exported model
        from tests.e2e.test_openai_api import assert_lm_eval_matches_hf

        export = Path(path).parent / "export"
        assert_lm_eval_matches_hf(url + "/v1", export, tmp_path, monkeypatch)
        os.kill(pid, signal.SIGTERM)  # rank 0 releases rank 1; both exit 0, so torchrun does
        assert server.wait(timeout=120) == 0, server.stderr.read()[-4000:]
        assert "megalite serve: stopped" in server.stderr.read()
    finally:
        if server.poll() is None:  # a failed check: torchrun passes SIGTERM on to its ranks
            server.terminate()  # (a SIGKILL to torchrun alone would leave them running)
            try:
                server.wait(timeout=60)
            except subprocess.TimeoutExpired:
                server.kill()
