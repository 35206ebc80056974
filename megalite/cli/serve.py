"""Serve generation over HTTP: Megatron's `PUT /api` and an OpenAI-style `POST /v1/completions`.

    python tools/serve.py --load DIR [--host 127.0.0.1] [--port 5000] [--tokenizer-model M]
    torchrun --nproc_per_node N tools/serve.py --load DIR --tp T --pp P [--ep E] [--port 5000]

    curl -s -X POST localhost:5000/v1/completions -H 'Content-Type: application/json' \\
         -d '{"prompt": "def main(", "max_tokens": 32, "temperature": 0}'

Every rank keeps its part of the model loaded (tools/generate.py's loading: any checkpoint, any
tp x pp, an MoE model's experts over --ep). Rank 0 answers HTTP with the standard library, one
request at a time: it checks and tokenizes a request, then broadcasts it to the other ranks
(JSON in a byte tensor, over the world group: nothing from the network is unpickled), and all
run the same generation. When idle,
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
from http.server import BaseHTTPRequestHandler, HTTPServer

import torch

from megalite.cli import generate as gen
from megalite.errors import MegaliteError, run_main
from megalite.generation import check_prompts
from megalite.generation import generate as generate_ids
from megalite.parallel import comm
from megalite.parallel.sampling import Sampling

MAX_BODY = 1 << 20
HEARTBEAT_S = 30.0


class BadRequest(Exception):
    pass


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


def parse_openai(body: dict) -> dict:
    """An OpenAI-style completions request (`POST /v1/completions`); `model` is ignored."""
    if _field(body, "n", int, 1) != 1:
        raise BadRequest("only n=1 is supported")
    for name in ("stream", "echo", "logprobs"):
        if body.get(name):
            raise BadRequest(f"{name!r} is not supported")
    return {
        "texts": _strings(body.get("prompt", ""), "prompt"),
        "max_new": _field(body, "max_tokens", int, 16, lambda n: n >= 0),
        "temperature": _field(body, "temperature", float, 1.0),
        "top_k": _field(body, "top_k", int, 0),
        "top_p": _field(body, "top_p", float, 1.0),
        "seed": _field(body, "seed", int, 0) if "seed" in body else None,
        "bos": False,
        "stop": _strings(body.get("stop", []), "stop"),
    }


class Server:
    """Rank 0's HTTP front and the generation every rank runs for a request."""

    def __init__(self, model: gen.Model, host="127.0.0.1", port=5000, heartbeat=HEARTBEAT_S):
        self.model, self.heartbeat = model, heartbeat
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

    def run(self, msg: dict) -> list[list[int]]:
        m = self.model
        sampling = Sampling(msg["temperature"], msg["top_k"], msg["top_p"])
        g = torch.Generator().manual_seed(msg["seed"])
        return generate_ids(m.chunks, m.groups, msg["prompts"], msg["max_new"], sampling, g,
                            m.tok.eos_id, gen.stop_at(m.tok, msg["stop"]))  # fmt: skip

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

    def complete(self, req: dict) -> list[tuple[str, str, int, int]]:
        """(text, finish reason, prompt tokens, new tokens) per prompt of a parsed request."""
        tok, cfg = self.model.tok, self.model.cfg
        if not req["texts"]:
            raise BadRequest("no prompt given")
        prompts = [([tok.bos_id] if req["bos"] else []) + gen.encode(tok, t) for t in req["texts"]]
        try:
            Sampling(req["temperature"], req["top_k"], req["top_p"]).check()
            check_prompts(prompts, cfg)
        except MegaliteError as e:
            raise BadRequest(str(e)) from None
        seed = req["seed"] if req["seed"] is not None else int(time.time_ns() % (1 << 31))
        msg = {k: req[k] for k in ("max_new", "temperature", "top_k", "top_p", "stop")}
        msg = self._broadcast({"op": "generate", "prompts": prompts, "seed": seed, **msg})
        new = self.run(msg)
        return [(*gen.finish(tok, ids, tok.eos_id, req["stop"]), len(p), len(ids))
                for p, ids in zip(prompts, new)]  # fmt: skip


def _handler(server: Server):
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
                raise BadRequest(f"request body over {MAX_BODY} bytes")
            try:
                body = json.loads(self.rfile.read(n) or b"{}")
            except (ValueError, UnicodeDecodeError) as e:
                raise BadRequest(f"body is not JSON: {e}") from None
            if not isinstance(body, dict):
                raise BadRequest("body must be a JSON object")
            return body

        def _answer(self, parse, respond):
            try:
                req = parse(self._body())
                self._reply(200, respond(req, server.complete(req)))
            except BadRequest as e:
                self._reply(400, {"error": str(e)})

        def do_PUT(self):
            if self.path != "/api":
                return self._reply(404, {"error": f"no PUT {self.path}; use PUT /api"})
            self._answer(parse_megatron, lambda req, out: {
                "text": [t + text for t, (text, *_) in zip(req["texts"], out)]})  # fmt: skip

        def do_POST(self):
            if self.path != "/v1/completions":
                return self._reply(404, {"error": f"no POST {self.path}; use /v1/completions"})
            self._answer(parse_openai, _openai_response)

        def do_GET(self):
            self._reply(200, {"status": "ok"})

    return Handler


def _openai_response(req, out) -> dict:
    choices = [{"index": i, "text": text, "finish_reason": reason, "logprobs": None}
               for i, (text, reason, _, _) in enumerate(out)]  # fmt: skip
    prompt, new = sum(p for _, _, p, _ in out), sum(n for *_, n in out)
    return {
        "id": f"cmpl-{time.time_ns():x}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": "megalite",
        "choices": choices,
        "usage": {"prompt_tokens": prompt, "completion_tokens": new, "total_tokens": prompt + new},
    }


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
    p.add_argument("--debug", action="store_true", help="full tracebacks")
    a = p.parse_args(argv)
    opened = gen.open_checkpoint(a.load, a.tokenizer_model)
    model = gen.load_at_layout(opened, a.tp, a.pp, a.dtype, a.ep)
    server = Server(model, a.host, a.port)
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
