"""The OpenAI API as megalite serve speaks it: requests checked into plain dicts, responses and
server-sent-event chunks built from a generation's result, errors in OpenAI's shape.

`/v1/completions`: `prompt` a string, a list of strings, a list of token ids or a list of such
lists; `max_tokens` (default 16; 0 with `echo` scores the prompt only, as lm-eval's
log-likelihood requests do), `temperature`, `top_p`, `top_k` (an extension), `n`, `seed`,
`stop` (a string or a list), `stream` (with `stream_options.include_usage`), `logprobs` (k: the
k likeliest tokens at each position, and always the chosen one), `echo` (the prompt's text and,
with logprobs, its tokens' log-probabilities: the first token's is null). `/v1/chat/completions`:
`messages` rendered with the model's chat template, `max_tokens` / `max_completion_tokens`
(default: until the context is full), `logprobs` / `top_logprobs`, and the sampling fields
above. Log-probabilities are the model's own distribution (temperature 1, no top-k/p), as
OpenAI reports them. Fields OpenAI defines but this server cannot honour (`suffix`, `best_of`,
`logit_bias`, penalties) are refused when set; other unknown fields are ignored (as vLLM does).
"""

import functools
import json
import re
import time
from pathlib import Path

from megalite.errors import MegaliteError

MAX_LOGPROBS = 20


class ApiError(Exception):
    """An error answered as {"error": {"message", "type", "param", "code"}} with `status`."""

    def __init__(self, message, param=None, status=400, type="invalid_request_error", code=None):
        super().__init__(message)
        self.status, self.param, self.type, self.code = status, param, type, code

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.type, "param": self.param,
                          "code": self.code}}  # fmt: skip


def _get(body, name, kinds, default, check=None, why=""):
    v = body.get(name)
    if v is None:
        return default
    if float in kinds and type(v) is int:
        v = float(v)
    if type(v) not in kinds:  # not isinstance: JSON true is no int
        names = " or ".join(k.__name__ for k in kinds)
        raise ApiError(f"'{name}' must be {names}, got {json.dumps(v)}", name)
    if check is not None and not check(v):
        raise ApiError(f"'{name}' has a bad value {json.dumps(v)}{why}", name)
    return v


def _stops(body) -> list[str]:
    v = body.get("stop")
    v = [] if v is None else [v] if isinstance(v, str) else v
    if not isinstance(v, list) or not all(isinstance(s, str) and s for s in v):
        raise ApiError("'stop' must be a non-empty string or a list of them", "stop")
    return v


def _refuse_unsupported(body):
    for name, off in (("suffix", None), ("best_of", None), ("logit_bias", None),
                      ("presence_penalty", 0), ("frequency_penalty", 0)):  # fmt: skip
        if body.get(name) not in (None, off, {}) and not (name == "best_of" and
                                                          body[name] == body.get("n", 1)):  # fmt: skip
            raise ApiError(f"'{name}' is not supported by this server", name)


def _sampling(body, default_max) -> dict:
    _refuse_unsupported(body)
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise ApiError("'stream_options' must be an object", "stream_options")
    return {
        "max_new": _get(body, "max_tokens", (int,), default_max, lambda n: n >= 0),
        "temperature": _get(body, "temperature", (float,), 1.0, lambda t: t >= 0),
        "top_k": max(_get(body, "top_k", (int,), 0, lambda k: k >= -1), 0),  # -1: off (vLLM's)
        "top_p": _get(body, "top_p", (float,), 1.0, lambda p: 0 < p <= 1),
        "n": _get(body, "n", (int,), 1, lambda n: 1 <= n <= 128),
        "seed": _get(body, "seed", (int,), None),
        "stop": _stops(body),
        "stream": _get(body, "stream", (bool,), False),
        "usage_chunk": bool((opts or {}).get("include_usage")),
    }


def parse_completion(body: dict, tok, vocab_size: int) -> dict:
    """A checked `/v1/completions` request: its prompts as token ids (and their texts)."""
    req = _sampling(body, 16)
    req["echo"] = _get(body, "echo", (bool,), False)
    req["logprobs"] = _get(body, "logprobs", (int,), None, lambda k: 0 <= k <= MAX_LOGPROBS,
                           f"; give 0 to {MAX_LOGPROBS}")  # fmt: skip
    p = body.get("prompt", "")
    if isinstance(p, str) or (isinstance(p, list) and p and all(type(t) is int for t in p)):
        p = [p]
    if not isinstance(p, list) or not p:
        raise ApiError("'prompt' must be a string, a list of token ids, or a list of either",
                       "prompt")  # fmt: skip
    ids, texts = [], []
    for one in p:
        if isinstance(one, str):
            ids.append(tok.encode(one) if one else [tok.bos_id])
            texts.append(one)
        elif isinstance(one, list) and one and all(type(t) is int for t in one):
            bad = [t for t in one if not 0 <= t < vocab_size]
            if bad:
                raise ApiError(f"token id {bad[0]} is outside the vocabulary [0, {vocab_size})",
                               "prompt")  # fmt: skip
            ids.append(one)
            texts.append(tok.decode(one))
        else:
            raise ApiError("each prompt must be a string or a non-empty list of token ids",
                           "prompt")  # fmt: skip
    req["prompts"], req["texts"] = ids, texts
    return req


def parse_chat(body: dict, template, tok) -> dict:
    """A checked `/v1/chat/completions` request: its messages rendered and tokenized."""
    req = _sampling(body, None)
    if body.get("max_completion_tokens") is not None:
        req["max_new"] = _get(body, "max_completion_tokens", (int,), None, lambda n: n >= 0)
    req["echo"] = False
    k = _get(body, "top_logprobs", (int,), 0, lambda k: 0 <= k <= MAX_LOGPROBS)
    req["logprobs"] = k if _get(body, "logprobs", (bool,), False) else None
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs or not all(isinstance(m, dict) for m in msgs):
        raise ApiError("'messages' must be a non-empty list of objects", "messages")
    for m in msgs:
        if not isinstance(m.get("role"), str):
            raise ApiError("every message needs a 'role' string", "messages")
        c = m.get("content")
        if isinstance(c, list):  # content parts: text only
            if not all(isinstance(x, dict) and x.get("type") == "text" for x in c):
                raise ApiError("only text content parts are supported", "messages")
            m["content"] = "".join(x.get("text", "") for x in c)
        elif c is not None and not isinstance(c, str):
            raise ApiError("a message's 'content' must be a string or text parts", "messages")
    if template is None:
        raise ApiError("this model has no chat template; start the server with --chat-template "
                       "FILE (a Jinja template or a tokenizer_config.json holding one), or use "
                       "/v1/completions", "messages")  # fmt: skip
    text = template.render(msgs)
    req["prompts"], req["texts"] = [encode_with_specials(tok, text)], [text]
    return req


# ---- the chat template ----------------------------------------------------------------------


def find_chat_template(path, dirs) -> str | None:
    """The chat template's source: from `path` (a .jinja file, or a tokenizer_config.json) or
    else the first of `dirs` holding chat_template.jinja or a tokenizer_config.json with one."""
    candidates = [Path(path)] if path else []
    for d in dirs:
        candidates += [Path(d) / "chat_template.jinja", Path(d) / "tokenizer_config.json"]
    for c in candidates:
        if not c.is_file():
            if path and c == Path(path):
                raise FileNotFoundError(f"--chat-template {path} does not exist")
            continue
        if c.suffix != ".json":
            return c.read_text()
        t = json.loads(c.read_text()).get("chat_template")
        if isinstance(t, list):  # named templates: the default one
            t = next((x["template"] for x in t if x.get("name") == "default"), None)
        if t:
            return t
        if path and c == Path(path):
            raise ValueError(f"--chat-template {path} holds no chat_template")
    return None


class ChatTemplate:
    """A Hugging Face style chat template (Jinja, sandboxed), rendered as transformers does:
    `messages`, `add_generation_prompt`, the tokenizer's `bos_token` / `eos_token`."""

    def __init__(self, source: str, special_tokens: dict):
        from jinja2 import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise ApiError(f"chat template: {message}", "messages")

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.filters["tojson"] = lambda x, indent=None: json.dumps(x, indent=indent)
        env.globals.update(raise_exception=raise_exception,
                           strftime_now=lambda f: time.strftime(f))  # fmt: skip
        try:
            self.template = env.from_string(source)
        except TemplateError as e:
            raise MegaliteError(f"the chat template does not parse: {e}") from None
        self.special = special_tokens

    def render(self, messages) -> str:
        from jinja2 import TemplateError

        try:
            return self.template.render(messages=messages, add_generation_prompt=True,
                                        tools=None, **self.special)  # fmt: skip
        except TemplateError as e:
            raise ApiError(f"chat template: {e}", "messages") from None


@functools.lru_cache(maxsize=4)
def special_ids(tok) -> dict[str, int]:
    """{text: id} of the tokenizer's special tokens (what a chat template writes as text)."""
    if hasattr(tok, "tok"):  # Hugging Face tokenizers
        return {t.content: i for i, t in tok.tok.get_added_tokens_decoder().items() if t.special}
    sp = tok.sp  # sentencepiece: its control pieces (<s>, </s>; user-defined ones encode as text)
    return {sp.IdToPiece(i): i for i in range(sp.GetPieceSize()) if sp.IsControl(i)}


def encode_with_specials(tok, text: str) -> list[int]:
    """`text` encoded with each special token's text as its id (the tokenizer's plain encoding
    treats such text as characters)."""
    specials = {s: i for s, i in special_ids(tok).items() if s}
    if not specials:
        return tok.encode(text)
    pattern = "|".join(re.escape(s) for s in sorted(specials, key=len, reverse=True))
    ids = []
    for k, part in enumerate(re.split(f"({pattern})", text)):
        ids += [specials[part]] if k % 2 else (tok.encode(part) if part else [])
    return ids


# ---- responses ------------------------------------------------------------------------------


def _text_in(tok, ctx, t) -> str:
    """What token t adds to the decoded text of `ctx` (a few ids before it): pieces that carry
    a space or merge bytes read as they do in the whole text."""
    head, whole = tok.decode(ctx), tok.decode([*ctx, t])
    return whole[len(head) :] if whole.startswith(head) else tok.decode([t])


def _piece(tok, t) -> str:
    """The tokenizer's own name of a token (a byte piece's, where its text is no character)."""
    if hasattr(tok, "sp"):
        return tok.sp.IdToPiece(t)
    return tok.tok.id_to_token(t) if hasattr(tok, "tok") else str(t)


def _scored(tok, ids, tops, before):
    """Per token: (its text, [(candidate name, logprob)]): each candidate named by the text it
    would add at that place, or by its piece when that is no whole character (or is taken)."""
    ctx, out = list(before)[-4:], []
    for t, top in zip(ids, tops):
        named = []
        if top is not None:
            seen = set()
            for i, v in top:
                name = _text_in(tok, ctx, i)
                if "\ufffd" in name or name in seen:
                    name = _piece(tok, i)
                seen.add(name)
                named.append((i, name, v))
        out.append((_text_in(tok, ctx, t), None if top is None else named))
        ctx = [*ctx[-3:], t]
    return out


def token_texts(tok, ids, before=()) -> list[str]:
    """Each token's text in context (`before`: the ids preceding the first)."""
    return [text for text, _ in _scored(tok, ids, [None] * len(ids), before)]


def completion_logprobs(tok, ids, lps, tops, start, before=(), first_null=False) -> dict:
    """OpenAI's completions logprobs for tokens `ids` (their logprobs `lps`, top (id, logprob)
    pairs `tops`) whose text starts at offset `start`; `first_null`: the first token has no
    logprob. The chosen token is always among top_logprobs (as OpenAI's)."""
    pre = [None] if first_null else []
    lps, tops = pre + list(lps), pre + list(tops)
    texts, offsets, top_dicts, at = [], [], [], start
    for t, lp, (text, named) in zip(ids, lps, _scored(tok, ids, tops, before)):
        texts.append(text)
        offsets.append(at)
        at += len(text)
        if named is None:
            top_dicts.append(None)
            continue
        d = {name: v for _, name, v in named}
        if t not in [i for i, _, _ in named]:
            d.setdefault(text, lp)
        top_dicts.append(d)
    return {"tokens": texts, "token_logprobs": lps, "top_logprobs": top_dicts,
            "text_offset": offsets}  # fmt: skip


def chat_logprobs(tok, ids, lps, tops, before=()) -> dict:
    """OpenAI's chat logprobs: {"content": [{"token", "logprob", "bytes", "top_logprobs"}]}."""
    rows = []
    for lp, (text, named) in zip(lps, _scored(tok, ids, tops, before)):
        rows.append({"token": text, "logprob": lp, "bytes": list(text.encode()),
                     "top_logprobs": [{"token": n, "logprob": v, "bytes": list(n.encode())}
                                      for _, n, v in named]})  # fmt: skip
    return {"content": rows}


def envelope(kind: str, model: str, rid: str, choices, usage=None) -> dict:
    out = {"id": rid, "object": kind, "created": int(time.time()), "model": model,
           "choices": choices}  # fmt: skip
    if usage is not None:
        out["usage"] = usage
    return out


def usage(prompts, new) -> dict:
    p, n = sum(map(len, prompts)), sum(map(len, new))
    return {"prompt_tokens": p, "completion_tokens": n, "total_tokens": p + n}


def sse(obj) -> bytes:
    return f"data: {json.dumps(obj)}\n\n".encode()


def model_list(model_id: str, created: int) -> dict:
    return {"object": "list", "data": [model_card(model_id, created)]}


def model_card(model_id: str, created: int) -> dict:
    return {"id": model_id, "object": "model", "created": created, "owned_by": "megalite"}
