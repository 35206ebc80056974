"""The server's answers to OpenAI requests: whole responses, and the server-sent events of a
streamed one (`data: {chunk}` per step, a last chunk per choice with its finish_reason, the
usage chunk when `stream_options.include_usage`, then `data: [DONE]`).

A streamed choice's text is sent as it grows, except a tail that could begin a stop string (or
an unfinished UTF-8 character): so the chunks joined are exactly the whole response's text.
Choices are numbered as OpenAI does: prompt i's j-th sample is choice i * n + j.
"""

import time

from megalite.cli import generate as gen
from megalite.cli import openai_api as api


def _rid(chat: bool) -> str:
    return f"{'chatcmpl' if chat else 'cmpl'}-{time.time_ns():x}"


def _merge(parts: list[dict]) -> dict:
    return {key: [v for p in parts for v in p[key]] for key in parts[0]}


def completion_response(server, req, prompts, r) -> dict:
    tok, n, echo = server.model.tok, req["n"], req["echo"]
    choices = []
    for i, (p, new) in enumerate(zip(prompts, r.tokens)):
        ptext = req["texts"][i // n]
        text, reason = gen.finish(tok, new, tok.eos_id, req["stop"])
        lp = None
        if req["logprobs"] is not None:  # offsets from the prompt's start, as OpenAI's
            parts = [api.completion_logprobs(tok, new, r.logprobs[i], r.top[i], len(ptext), p)]
            if echo:
                parts.insert(0, api.completion_logprobs(tok, p, r.prompt_logprobs[i],
                                                        r.prompt_top[i], 0, first_null=True))  # fmt: skip
            lp = _merge(parts)
        choices.append({"index": i, "text": (ptext if echo else "") + text, "logprobs": lp,
                        "finish_reason": reason})  # fmt: skip
    return api.envelope("text_completion", server.model_id, _rid(False), choices,
                        api.usage(prompts, r.tokens))  # fmt: skip


def chat_response(server, req, prompts, r) -> dict:
    tok = server.model.tok
    choices = []
    for i, (p, new) in enumerate(zip(prompts, r.tokens)):
        text, reason = gen.finish(tok, new, tok.eos_id, req["stop"])
        lp = None
        if req["logprobs"] is not None:
            lp = api.chat_logprobs(tok, new, r.logprobs[i], r.top[i], p)
        choices.append({"index": i, "message": {"role": "assistant", "content": text},
                        "logprobs": lp, "finish_reason": reason})  # fmt: skip
    return api.envelope("chat.completion", server.model_id, _rid(True), choices,
                        api.usage(prompts, r.tokens))  # fmt: skip


class Stream:
    """A streamed response on `handler`'s connection: `step` is generation's on_step, `finish`
    sends what is left. A client that goes away only stops the writing (every rank's
    generation runs to its end)."""

    def __init__(self, handler, server, req, chat: bool):
        self.h, self.server, self.req, self.chat = handler, server, req, chat
        self.tok, self.stops = server.model.tok, req["stop"]
        self.kind = "chat.completion.chunk" if chat else "text_completion"
        self.rid = _rid(chat)
        self.prompts = [p for p in req["prompts"] for _ in range(req["n"])]
        rows = len(self.prompts)
        self.ids, self.sent, self.done = [[] for _ in range(rows)], [""] * rows, [False] * rows
        self.started = self.closed = False

    def _write(self, data: bytes):
        if self.closed:
            return
        try:
            self.h.wfile.write(data)
            self.h.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            self.closed = True

    def _chunk(self, i, text, lp=None, reason=None, role=False):
        if self.chat:
            delta = {"role": "assistant", "content": ""} if role else {}
            if text:
                delta["content"] = text
            choice = {"index": i, "delta": delta, "logprobs": lp, "finish_reason": reason}
        else:
            choice = {"index": i, "text": text, "logprobs": lp, "finish_reason": reason}
        env = api.envelope(self.kind, self.server.model_id, self.rid, [choice])
        self._write(api.sse(env))

    def _begin(self):
        h = self.h
        h.send_response(200)
        h.send_header("Content-Type", "text/event-stream")
        h.send_header("Cache-Control", "no-cache")
        h.end_headers()
        self.started = True
        for i in range(len(self.prompts)):
            if self.chat:
                self._chunk(i, "", role=True)
            elif self.req["echo"]:
                self._chunk(i, self.req["texts"][i // self.req["n"]])

    def _safe_text(self, i) -> tuple[str, bool]:
        """(the text that may be sent, whether a stop string ended the row)."""
        text = self.tok.decode([t for t in self.ids[i] if t != self.tok.eos_id])
        cuts = [text.index(s) for s in self.stops if s in text]
        if cuts:
            return text[: min(cuts)], True
        hold = max((n for s in self.stops for n in range(1, len(s)) if text.endswith(s[:n])),
                   default=0)  # fmt: skip
        return text[: len(text) - hold].rstrip("\ufffd"), False

    def step(self, step, ids, pack):
        if not self.started:
            self._begin()
        k = self.req["logprobs"]
        for i, t in enumerate(ids):
            if self.done[i]:
                continue
            before = self.prompts[i] + self.ids[i]
            self.ids[i].append(t)
            safe, stopped = self._safe_text(i)
            self.done[i] = t == self.tok.eos_id or stopped
            delta = safe[len(self.sent[i]) :] if safe.startswith(self.sent[i]) else ""
            self.sent[i] += delta
            lp = None
            if k is not None:
                row = pack[i].tolist()
                top = [list(zip(map(int, row[1 + k :]), row[1 : 1 + k]))]
                if self.chat:
                    lp = api.chat_logprobs(self.tok, [t], [row[0]], top, before)
                else:
                    at = len(self.req["texts"][i // self.req["n"]]) + len(self.sent[i]) - len(delta)
                    lp = api.completion_logprobs(self.tok, [t], [row[0]], top, at, before)
            if delta or lp is not None:
                self._chunk(i, delta, lp)

    def finish(self, prompts, r):
        if not self.started:
            self._begin()
        for i, new in enumerate(r.tokens):
            text, reason = gen.finish(self.tok, new, self.tok.eos_id, self.stops)
            rest = text[len(self.sent[i]) :] if text.startswith(self.sent[i]) else ""
            if rest:
                self._chunk(i, rest)
            self._chunk(i, "", reason=reason)
        if self.req["usage_chunk"]:
            env = api.envelope(self.kind, self.server.model_id, self.rid, [],
                               api.usage(prompts, r.tokens))  # fmt: skip
            self._write(api.sse(env))
        self._write(b"data: [DONE]\n\n")
