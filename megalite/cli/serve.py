"""Serve generation over HTTP: the OpenAI API (`/v1/completions`, `/v1/chat/completions`,
`/v1/models`; megalite/cli/openai_api.py) and Megatron's `PUT /api`.

    python tools/serve.py --load DIR [--host 127.0.0.1] [--port 5000] [--tokenizer-model M]
        [--served-model-name NAME] [--chat-template FILE]
    torchrun --nproc_per_node N tools/serve.py --load DIR --tp T --pp P [--ep E] [--port 5000]

    curl -s -X POST localhost:5000/v1/completions -H 'Content-Type: application/json' \\
         -d '{"prompt": "def main(", "max_tokens": 32, "temperature": 0}'

Every rank keeps its part of the model loaded (tools/generate.py's loading: any checkpoint, any
tp x pp, an MoE model's experts over --ep). Rank 0 answers HTTP with the standard library, one
request at a time: it checks and tokenizes a request, then broadcasts it to the other ranks
(JSON in a byte tensor, over the world group: nothing from the network is unpickled), and all
run the same generation (with log-probabilities when asked: generation.generate_scored); a
streamed answer is written by rank 0 step by step (megalite/cli/openai_responses.py). When idle,
rank 0 broadcasts a heartbeat, so the others never reach the process-group timeout while they
wait. SIGINT or SIGTERM on rank 0 (Ctrl-C; torchrun passes it on) ends the loop within half a
second; a stop message releases the other ranks and every rank exits 0. `--port 0` picks a free
port; rank 0 prints the address it serves on and its pid.
"""

import argparse
import json
import os
import signal
import sys
import threading
import time
import traceback
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import torch

from megalite.cli import generate as gen
from megalite.cli import openai_api as api
from megalite.cli.openai_api import ApiError
from megalite.errors import MegaliteError, run_main
from megalite.generation import check_prompts, context_length, generate_scored
from megalite.parallel import comm
from megalite.parallel.sampling import Sampling

MAX_BODY = 1 << 20
HEARTBEAT_S = 30.0
BadRequest = ApiError  # PUT /api answers its message alone, as Megatron's server


def _field(body: dict, name: str, kind, default, check=None):
    v = body.get(name, default)
    if kind is float and type(v) is int:
        v = float(v)
    if type(v) is not kind:  # not isinstance: JSON true is no int
        raise BadRequest(f"field {name!r} must be {kind.__name__}, got {json.dumps(v)}")
    if check and not check(v):
        raise BadRequest(f"field {name!r} has a bad value {json.dumps(v)}")
    return v


def _strings(v, name) -> list[str]:
    v = [v] if isinstance(v, str) else v
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise BadRequest(f"field {name!r} must be a string or a list of strings")
    return v


def parse_megatron(body: dict) -> dict:
    """Megatron's text generation server request (`PUT /api`); top_p 0 means off, as there."""
    known = {"prompts", "tokens_to_generate", "temperature", "top_k", "top_p", "random_seed",
             "add_BOS", "logprobs", "stop"}  # fmt: skip
    unknown = sorted(set(body) - known)
    if unknown:
        raise BadRequest(f"unknown field {unknown[0]!r}; PUT /api takes {', '.join(sorted(known))}")
    if body.get("logprobs"):
        raise BadRequest("logprobs are not supported")
    top_p = _field(body, "top_p", float, 0.0, lambda p: 0 <= p <= 1)
    return {
        "texts": _strings(body.get("prompts"), "prompts"),
        "max_new": _field(body, "tokens_to_generate", int, 64, lambda n: n >= 0),
        "temperature": _field(body, "temperature", float, 1.0),
        "top_k": _field(body, "top_k", int, 0),
        "top_p": top_p if top_p > 0 else 1.0,
        "seed": _field(body, "random_seed", int, 0) if "random_seed" in body else None,
        "bos": _field(body, "add_BOS", bool, False),
        "stop": _strings(body.get("stop", []), "stop"),
    }


class Server:
    """Rank 0's HTTP front and the generation every rank runs for a request."""

    def __init__(self, model: gen.Model, host="127.0.0.1", port=5000, heartbeat=HEARTBEAT_S,
                 model_id="megalite", chat_template=None):  # fmt: skip
        self.model, self.heartbeat = model, heartbeat
        self.model_id, self.created = model_id, int(time.time())
        self.chat = None
        if chat_template is not None:
            self.chat = api.ChatTemplate(chat_template, model.tok.special_tokens)
        self.stopping = threading.Event()
        self.httpd = None
        if model.groups.rank == 0:
            self.httpd = HTTPServer((host, port), _handler(self))
            self.httpd.timeout = 0.5  # how soon a stop is noticed
            self.port = self.httpd.server_address[1]
        self._last = time.monotonic()

    # ---- every rank ------------------------------------------------------------------------

    def _broadcast(self, msg: dict | None) -> dict:
        """Rank 0's message (others pass None) on every rank: its length, then UTF-8 JSON."""
        world, device = self.model.groups.world, self.model.groups.device
        self._last = time.monotonic()
        if msg is not None:
            data = torch.frombuffer(bytearray(json.dumps(msg).encode()), dtype=torch.uint8)
            comm.broadcast(torch.tensor([data.numel()], device=device), 0, world)
            comm.broadcast(data.to(device), 0, world)
            return msg
        n = torch.empty(1, dtype=torch.int64, device=device)
        comm.broadcast(n, 0, world)
        data = torch.empty(int(n.item()), dtype=torch.uint8, device=device)
        comm.broadcast(data, 0, world)
        return json.loads(data.cpu().numpy().tobytes())

    def run(self, msg: dict, on_step=None):
        """The generation of a broadcast request (megalite.generation.Generated)."""
        m = self.model
        sampling = Sampling(msg["temperature"], msg["top_k"], msg["top_p"])
        g = torch.Generator().manual_seed(msg["seed"])
        if on_step is not None:  # rank 0's writer: a failure there must not stop this rank's
            on_step = _guarded(on_step)  # generation while the others go on with theirs
        return generate_scored(m.chunks, m.groups, msg["prompts"], msg["max_new"], sampling, g,
                               m.tok.eos_id, gen.stop_at(m.tok, msg["stop"]),
                               logprobs=msg.get("logprobs"), echo=msg.get("echo", False),
                               on_step=on_step)  # fmt: skip

    def follow(self):
        """Ranks other than 0: run what rank 0 broadcasts until it says stop."""
        while True:
            msg = self._broadcast(None)
            if msg["op"] == "stop":
                return
            if msg["op"] == "generate":
                self.run(msg)

    # ---- rank 0 ----------------------------------------------------------------------------

    def serve(self):
        """Answer requests until `stop()`; then release the other ranks."""
        try:
            while not self.stopping.is_set():
                self.httpd.handle_request()  # one request, or none within the timeout
                if time.monotonic() - self._last > self.heartbeat:
                    self._broadcast({"op": "noop"})
        finally:
            self.httpd.server_close()
            self._broadcast({"op": "stop"})

    def stop(self):
        self.stopping.set()

    def generate(self, req: dict, on_step=None):
        """(prompts, Generated) of a parsed request: each prompt n times, checked, then
        broadcast and generated on every rank. Prompt scores only when logprobs are asked."""
        cfg = self.model.cfg
        prompts = [p for p in req["prompts"] for _ in range(req.get("n", 1))]
        try:
            Sampling(req["temperature"], req["top_k"], req["top_p"]).check()
            check_prompts(prompts, cfg)
        except MegaliteError as e:
            raise ApiError(str(e), "prompt") from None
        seed = req["seed"] if req["seed"] is not None else int(time.time_ns() % (1 << 31))
        max_new = req["max_new"] if req["max_new"] is not None else context_length(cfg)
        msg = {"op": "generate", "prompts": prompts, "seed": seed, "max_new": max_new,
               **{k: req[k] for k in ("temperature", "top_k", "top_p", "stop")},
               "logprobs": req.get("logprobs"),
               "echo": bool(req.get("echo")) and req.get("logprobs") is not None}  # fmt: skip
        return prompts, self.run(self._broadcast(msg), on_step)

    def complete(self, req: dict) -> list[tuple[str, str, int, int]]:
        """PUT /api: (text, finish reason, prompt tokens, new tokens) per prompt."""
        tok = self.model.tok
        if not req["texts"]:
            raise BadRequest("no prompt given")
        req = {**req, "prompts": [([tok.bos_id] if req["bos"] else []) + gen.encode(tok, t)
                                  for t in req["texts"]]}  # fmt: skip
        prompts, r = self.generate(req)
        return [(*gen.finish(tok, ids, tok.eos_id, req["stop"]), len(p), len(ids))
                for p, ids in zip(prompts, r.tokens)]  # fmt: skip

    def check_model(self, body: dict):
        name = body.get("model")
        if name is not None and name != self.model_id:
            raise ApiError(f"the model {name!r} does not exist; this server serves "
                           f"{self.model_id!r}", "model", 404, code="model_not_found")  # fmt: skip


def _guarded(fn):
    """fn, its first exception logged and then no more calls."""
    failed = []

    def call(*args):
        if failed:
            return
        try:
            fn(*args)
        except Exception:
            failed.append(True)
            traceback.print_exc()

    return call


def _handler(server: Server):
    from megalite.cli.openai_responses import Stream, chat_response, completion_response

    class Handler(BaseHTTPRequestHandler):
        def _reply(self, code: int, obj: dict):
            data = json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _body(self) -> dict:
            n = int(self.headers.get("Content-Length") or 0)
            if n > MAX_BODY:
                raise ApiError(f"request body over {MAX_BODY} bytes", status=413)
            try:
                body = json.loads(self.rfile.read(n) or b"{}")
            except (ValueError, UnicodeDecodeError) as e:
                raise ApiError(f"body is not JSON: {e}") from None
            if not isinstance(body, dict):
                raise ApiError("body must be a JSON object")
            return body

        def do_PUT(self):
            if self.path != "/api":
                return self._reply(404, {"error": f"no PUT {self.path}; use PUT /api"})
            try:
                req = parse_megatron(self._body())
                out = server.complete(req)
                self._reply(200, {"text": [t + text for t, (text, *_) in zip(req["texts"], out)]})
            except ApiError as e:
                self._reply(e.status, {"error": str(e)})

        def do_POST(self):
            chat = self.path == "/v1/chat/completions"
            if self.path not in ("/v1/completions", "/v1/chat/completions"):
                e = ApiError(f"no POST {self.path}; use /v1/completions or /v1/chat/completions",
                             status=404, code="unknown_url")  # fmt: skip
                return self._reply(404, e.body())
            m, stream = server.model, None
            try:
                body = self._body()
                server.check_model(body)
                if chat:
                    req = api.parse_chat(body, server.chat, m.tok)
                else:
                    req = api.parse_completion(body, m.tok, m.cfg.vocab_size)
                if req["stream"] and req["echo"] and req["logprobs"] is not None:
                    raise ApiError("echo with logprobs cannot stream; set stream false", "stream")
                if req["stream"]:  # the request is checked before the first byte is sent
                    stream = Stream(self, server, req, chat)
                    stream.finish(*server.generate(req, stream.step))
                    return
                prompts, r = server.generate(req)
                build = chat_response if chat else completion_response
                self._reply(200, build(server, req, prompts, r))
            except ApiError as e:
                if stream is None or not stream.started:
                    self._reply(e.status, e.body())
            except Exception as e:  # a bug: answered as OpenAI's server_error, logged here
                traceback.print_exc()
                err = ApiError(f"internal error: {type(e).__name__}: {e}", status=500,
                               type="server_error")  # fmt: skip
                if stream is None or not stream.started:
                    self._reply(500, err.body())

        def do_GET(self):
            path = self.path.split("?")[0].rstrip("/")
            if path == "/v1/models":
                return self._reply(200, api.model_list(server.model_id, server.created))
            if path == f"/v1/models/{server.model_id}":
                return self._reply(200, api.model_card(server.model_id, server.created))
            if path == "/health":
                return self._reply(200, {"status": "ok"})
            code = "model_not_found" if path.startswith("/v1/models/") else "unknown_url"
            e = ApiError(f"no GET {self.path}; use /v1/models or /health", status=404, code=code)
            self._reply(404, e.body())

    return Handler


def model_name(load) -> str:
    """A checkpoint's model id: its directory's name (a run's, for one of its iter_* folders)."""
    path = Path(load).resolve()
    return path.parent.name if path.name.startswith("iter_") else path.name


def main(argv):
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    p.add_argument("--load", required=True, help="checkpoint directory")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=5000, help="0: any free port")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel size")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel size (MoE models)")
    p.add_argument("--dtype", choices=["auto", *sorted(gen.DTYPES)], default="auto",
                   help="compute dtype (auto: the checkpoint's)")  # fmt: skip
    p.add_argument("--tokenizer-model", help="sentencepiece model (default: the checkpoint's)")
    p.add_argument("--served-model-name", help="the model id of /v1/models and responses "
                   "(default: the checkpoint directory's name)")  # fmt: skip
    p.add_argument("--chat-template", help="a Jinja chat template, or a tokenizer_config.json "
                   "holding one (default: the checkpoint's chat_template.jinja or "
                   "tokenizer_config.json, if any)")  # fmt: skip
    p.add_argument("--debug", action="store_true", help="full tracebacks")
    a = p.parse_args(argv)
    opened = gen.open_checkpoint(a.load, a.tokenizer_model)
    try:
        template = api.find_chat_template(a.chat_template, [a.load, opened[0].dir])
    except (OSError, ValueError) as e:
        raise MegaliteError(str(e)) from None
    model = gen.load_at_layout(opened, a.tp, a.pp, a.dtype, a.ep)
    server = Server(model, a.host, a.port, model_id=a.served_model_name or model_name(a.load),
                    chat_template=template)  # fmt: skip
    if model.groups.rank == 0:
        for s in (signal.SIGINT, signal.SIGTERM):
            signal.signal(s, lambda *_: server.stop())
        print(f"serving on http://{a.host}:{server.port} (pid {os.getpid()}: SIGINT or SIGTERM "
              "stops it)", flush=True)  # fmt: skip
        server.serve()
        print("megalite serve: stopped", file=sys.stderr, flush=True)
    else:  # leave when rank 0 says so, not at the signal torchrun passes on to every rank
        for s in (signal.SIGINT, signal.SIGTERM):
            signal.signal(s, signal.SIG_IGN)
        server.follow()
    model.close()


def cli():
    """The console entry point megalite-serve."""
    sys.exit(run_main(main))
