"""An OpenAI-compatible HTTP server on the engine (the `serve` extra: FastAPI + uvicorn).

    >>> from hf_paged_kv.serve.app import create_app
    >>> app = create_app(Engine(model, tokenizer=tok, pool=KVPool(num_blocks=512)), "my-model")
    >>> uvicorn.run(app, port=8000)          # or: python -m hf_paged_kv.serve --model DIR

Routes: `POST /v1/completions`, `POST /v1/chat/completions` (both with `stream: true` as
server-sent events ending in `data: [DONE]`), `GET /v1/models`, `POST /tokenize` and
`/detokenize` (vLLM's), `GET /version`, `GET /metrics` (the engine's Prometheus text),
`GET /health`. With an API key, every route but the last three answers 401 without it. Every
response carries `X-Request-Id` (the request's own, else a new one). The engine runs in this
process: the app starts it when it starts and stops it when it stops.

- `temperature: 0` is greedy; otherwise `temperature`, `top_p` sample, reproducibly with `seed`
  (any 64-bit integer). `presence_penalty` and `frequency_penalty` (-2..2, over the output so
  far) and `logit_bias` (token id -> -100..100) as OpenAI defines them. `n` choices per prompt
  (up to 128 choices in all; a seeded request's choice k is seeded `seed + k`) share the
  prompt's cached blocks; `/v1/completions` takes a list of prompts (text or token ids), one
  choice each (`n` each), in order. A chat completion without `max_tokens` may fill what the
  context leaves, or what one request can hold in the pool if that is less. A message's `name` goes to the chat template; the fields of
  an answer sent back as history (`refusal`, `tool_calls`, ...) are dropped when empty. `stop`
  (up to 4 strings of up to 1,000 characters) ends the text before the first match. Integer
  fields take integers only, not `true`. `usage.prompt_tokens_details.cached_tokens` counts the
  prompt tokens whose KV was found cached.
- vLLM's extensions: `top_k` (0 or -1: off), `min_p`, `repetition_penalty` (transformers', over
  prompt and output), `min_tokens` (no end token before), `ignore_eos`, `stop_token_ids` (tokens
  that end the text as EOS does, their text left out, with `finish_reason: "stop"`),
  `include_stop_str_in_output` (a matched stop string stays in the text),
  `skip_special_tokens` (default true), `return_token_ids` (the token ids of the prompt and of
  each choice, or of each chunk's text), `cache_salt` (requests reuse each other's cached
  prefixes only when their salts, and tenants, are equal) and
  `stream_options.continuous_usage_stats` (every chunk carries the usage so far).
- Log-probabilities: chat `logprobs`/`top_logprobs`, completions `logprobs` (up to 20
  alternatives): the model's own log-softmax, before penalties, bias and temperature.
- `response_format`: `json_object` or `json_schema` (see `engine.grammar`): the output is held to
  it while it is sampled; a schema that cannot be compiled is a 400.
- `tools`, `tool_choice`: see `tools`; assistant `tool_calls` and `tool` messages in the history.
- Completions: `best_of` samples per prompt, of which the `n` of the highest total
  log-probability are returned (not streamed); `echo` puts the prompt's text before each
  completion (not with `logprobs`).
- A field of OpenAI's API this server does not implement (`suffix`, ...) is refused with a 400 in OpenAI's error shape, unless it carries its
  neutral value, as many clients send those by default. A field it does not know at all is
  accepted and ignored, as OpenAI and vLLM do, and logged once per field name.
- Prompts are tokenized and chat templates applied on worker threads, not the event loop: a
  huge prompt does not stall the other streams.
- The tenant of a request (whose cached KV it may reuse) is "default", with its `cache_salt`
  if any; where the operator trusts them (`trust_headers`, behind a proxy that sets them), the
  `X-Tenant` header names it and `X-Priority` (an int) sets its scheduling priority. A client
  never picks another's tenant by itself; `user` is OpenAI's end-user id and only that.
- When the engine sheds load the answer is 429 with `Retry-After` (whole seconds, rounded up),
  also for a request turned away while it waited: a streamed answer's status line waits for the
  first token, so a request shed or failed before it gets its own status (429, 500); a failure
  after it ends the stream with an error event and `data: [DONE]`.
- A client that disconnects, streaming or not, cancels its request; the engine frees its blocks.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import secrets
import threading
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, ClassVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, StrictBool, StrictFloat, StrictInt, model_validator
from starlette.exceptions import HTTPException as StarletteHTTPException

from .. import __version__
from ..arguments import is_unicode
from ..engine.grammar import GrammarError
from ..engine.request import MAX_LOGPROBS, RequestFailed
from ..errors import Overloaded, PagedKVError
from .tools import ToolError, Tools, hermes_messages, knows_tools

PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
MAX_STOP_STRINGS = 4
# Matching a stop string costs up to its length per token, on the event loop: OpenAI documents
# no limit, and a stop string of a thousand characters is already more than a sentence.
MAX_STOP_LENGTH = 1000
DETOKENIZER_CONTEXT = 5  # prompt tokens decoded with a completion's first tokens (leading spaces)
MAX_CHOICES = 128  # choices per request (prompts x n): OpenAI's bound on n
MAX_LOGIT_BIAS = 100  # OpenAI's bound on a logit_bias value (either sign)
MAX_PENALTY = 2  # OpenAI's bound on presence_penalty and frequency_penalty (either sign)
ANY = object()
log = logging.getLogger("hf_paged_kv.serve")

# Fields of OpenAI's API this server does not implement, with the values that mean "off": a
# client sends their neutral values by default. Any other field it does not know is ignored.
NEUTRAL_COMMON = {"service_tier": (None, "auto", "default"), "store": (None, False), "metadata": ANY}
NEUTRAL_COMPLETION = NEUTRAL_COMMON | {
                                       "suffix": (None, "")}
NEUTRAL_CHAT = NEUTRAL_COMMON | {
    "functions": (None, []), "function_call": (None, "none", "auto"),
    "modalities": (None, ["text"]), "audio": (None,),
    "prediction": (None,), "reasoning_effort": (None,), "web_search_options": (None,),
    "add_generation_prompt": (None, True), "chat_template_kwargs": (None, {})}
# What a message sent back as history holds in the fields of an answer this server never gives.
EMPTY_VALUES = (None, [], {}, "")


# ------------------------------------------------------------------------------------ errors
class APIError(Exception):
    """An error answered in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def invalid(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def rate_limited(error: Overloaded) -> APIError:
    """429 with `Retry-After` in whole seconds, rounded up."""
    return APIError(429, f"The server is overloaded: {error}", kind="requests", code="rate_limit_exceeded",
                    headers={"Retry-After": str(max(1, math.ceil(error.retry_after)))})


# ---------------------------------------------------------------------------- request bodies
class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")  # unknown options are ignored, as unknown fields are
    include_usage: bool = False
    continuous_usage_stats: bool = False  # extension (vLLM): every chunk carries the usage so far


class GenerationRequest(BaseModel):
    """The fields both endpoints share; anything else lands in `model_extra` and is checked.
    Numbers are strict: pydantic's lax mode would take JSON's `true` for 1."""

    model_config = ConfigDict(extra="allow")
    prompt_field: ClassVar[str] = "prompt"  # what errors about the prompt name
    model: str
    max_tokens: StrictInt | None = None
    temperature: StrictFloat | None = None  # strict still takes an integer (1), not a bool
    top_p: StrictFloat | None = None
    top_k: StrictInt | None = None  # extension (vLLM): 0 or -1 is off
    min_p: StrictFloat | None = None  # extension (vLLM)
    presence_penalty: StrictFloat | None = None
    frequency_penalty: StrictFloat | None = None
    repetition_penalty: StrictFloat | None = None  # extension (vLLM)
    logit_bias: dict[str, StrictFloat] | None = None  # token id (as text) -> bias
    min_tokens: StrictInt | None = None  # extension (vLLM)
    n: StrictInt | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    seed: StrictInt | None = None
    stop: str | list[str] | None = None
    user: str | None = None
    ignore_eos: bool | None = False  # extension (vLLM)
    return_token_ids: bool | None = False  # extension (vLLM)
    stop_token_ids: list[StrictInt] | None = None  # extension (vLLM)
    include_stop_str_in_output: StrictBool | None = False  # extension (vLLM)
    skip_special_tokens: StrictBool | None = True  # extension (vLLM)
    cache_salt: str | None = None  # extension (vLLM)
    response_format: dict[str, Any] | None = None  # text, json_object or json_schema (also on completions, as vLLM)

    @model_validator(mode="before")
    @classmethod
    def text_only(cls, data):
        """JSON lets a string hold a lone surrogate (a client that cut text inside an emoji),
        which no tokenizer, block digest or response can encode: a 400 naming the field."""
        where = unencodable(data)
        if where is not None:
            raise ValueError(f"{where} holds a lone surrogate (\\ud800-\\udfff), which is not Unicode text")
        return data

    def max_tokens_field(self) -> str:
        """The field that set the completion's length, as errors about it name it."""
        return "max_tokens"

    def alternatives(self) -> tuple[int | None, str]:
        """How many likeliest tokens to show beside each token's log-probability (None: no
        log-probabilities), and the field that asked."""
        return None, "logprobs"


class TokenizeRequest(BaseModel):
    """vLLM's `/tokenize`: a prompt (with `add_special_tokens`) or chat messages (templated)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool = True


class DetokenizeRequest(BaseModel):
    model: str | None = None
    tokens: list[StrictInt]


class CompletionRequest(GenerationRequest):
    prompt: str | list[StrictInt] | list[str] | list[list[StrictInt]]
    logprobs: StrictInt | None = None
    best_of: StrictInt | None = None  # samples drawn per prompt, of which the n likeliest are returned
    echo: StrictBool | None = None  # the prompt's text before each completion

    def alternatives(self) -> tuple[int | None, str]:
        return self.logprobs, "logprobs"


class ChatRequest(GenerationRequest):
    prompt_field: ClassVar[str] = "messages"
    messages: list[dict[str, Any]]
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None  # one call or several per answer: both are parsed

    def alternatives(self) -> tuple[int | None, str]:
        if self.top_logprobs is not None and not self.logprobs:
            raise invalid("top_logprobs needs logprobs: true", "top_logprobs")
        return ((self.top_logprobs or 0) if self.logprobs else None), "top_logprobs"

    def max_tokens_field(self) -> str:
        return "max_tokens" if self.max_completion_tokens is None else "max_completion_tokens"


def unencodable(value, where: str = "body") -> str | None:
    """Where the first string (or key) in `value` that UTF-8 cannot encode is, else None."""
    if isinstance(value, str):
        return None if is_unicode(value) else where
    if isinstance(value, dict):
        for key, item in value.items():
            if not is_unicode(str(key)):
                return f"a key of {where}"  # never echoed: the response could not encode it either
            if (found := unencodable(item, f"{where}.{key}")) is not None:
                return found
    if isinstance(value, list):
        for index, item in enumerate(value):
            if (found := unencodable(item, f"{where}[{index}]")) is not None:
                return found
    return None


MAX_LOGGED_FIELDS = 100  # distinct unknown field names logged; names are the client's to choose


def check_extras(body: GenerationRequest, neutral: dict, ignored: set[str]) -> None:
    """400 for a field this server knows but does not implement, sent with a value other than its
    neutral one; a field it does not know is ignored, and logged the first time (`ignored`: the
    names logged so far, up to `MAX_LOGGED_FIELDS`)."""
    extras = dict(body.model_extra or {})
    if body.stream_options is not None:
        extras.update({f"stream_options.{k}": v for k, v in (body.stream_options.model_extra or {}).items()})
    for name, value in extras.items():
        if name not in neutral:
            if name not in ignored and len(ignored) < MAX_LOGGED_FIELDS:
                ignored.add(name)
                log.warning("ignoring the request field %r, which this server does not know (logged once%s)",
                            name[:100], "; no more are logged" if len(ignored) == MAX_LOGGED_FIELDS else "")
            continue
        allowed = neutral[name]
        if allowed is not ANY and not any(same_value(value, v) for v in allowed):
            shown = " or ".join(json.dumps(v) for v in allowed)
            raise invalid(f"'{name}' is not supported by this server (hf_paged_kv); omit it or send {shown}",
                          param=name, code="unsupported_parameter")


def same_value(value, neutral) -> bool:
    """`value == neutral`, but a bool equals only a bool (Python's `True == 1` would let
    `repetition_penalty: true` pass for 1)."""
    return value == neutral and isinstance(value, bool) == isinstance(neutral, bool)


# -------------------------------------------------------------------------------- text output
class Detokenizer:
    """Token ids to text as they come, never splitting a multi-byte character: each new piece is
    the decoded tail of a short window minus the decoded window before it (as TGI and vLLM do).
    `context` (the prompt's last tokens) makes a completion's first piece carry its leading space."""

    def __init__(self, tokenizer, context: list[int] = (), skip_special_tokens: bool = True):
        self.tokenizer, self.skip_special_tokens = tokenizer, skip_special_tokens
        self.ids = list(context)
        self.prefix, self.read = 0, len(self.ids)

    def add(self, token: int) -> str:
        self.ids.append(token)
        return self.advance(final=False)

    def advance(self, final: bool) -> str:
        before = self.decode(self.ids[self.prefix:self.read])
        after = self.decode(self.ids[self.prefix:])
        if len(after) > len(before) and (final or not after.endswith("\ufffd")):
            self.prefix, self.read = self.read, len(self.ids)
            return after[len(before):]
        return ""

    def decode(self, ids: list[int]) -> str:
        if not ids or self.tokenizer is None:  # a server without a tokenizer answers in token ids only
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)


class StopMatcher:
    """Holds back text that may begin a stop string; reports the first stop string met."""

    def __init__(self, stops: list[str], include: bool = False):
        self.stops, self.pending, self.include = [s for s in stops if s], "", include

    def feed(self, text: str) -> tuple[str, bool]:
        """(text safe to emit, whether a stop string was met: the text then ends before it, or
        with it when `include`)."""
        self.pending += text
        hits = [(self.pending.find(s), s) for s in self.stops if s in self.pending]
        if hits:
            start, stop = min(hits, key=lambda hit: (hit[0], -len(hit[1])))
            emit, self.pending = self.pending[: start + (len(stop) if self.include else 0)], ""
            return emit, True
        hold = max((self.overlap(s) for s in self.stops), default=0)
        emit, self.pending = self.pending[: len(self.pending) - hold], self.pending[len(self.pending) - hold:]
        return emit, False

    def overlap(self, stop: str) -> int:
        """The length of the longest tail of the pending text that begins `stop`: from the
        longest candidate down, so that a match usually ends the search at once."""
        for k in range(min(len(stop) - 1, len(self.pending)), 0, -1):
            if stop.startswith(self.pending[-k:]):
                return k
        return 0

    def flush(self) -> str:
        emit, self.pending = self.pending, ""
        return emit


class Generation:
    """One request's tokens as text pieces, its finish reason, and its cancellation when the
    reader goes away (a disconnected client) or a stop string ends it early."""

    def __init__(self, index: int, handle, detokenizer: Detokenizer, stops: StopMatcher, eos: set[int],
                 logprobs: bool = False):
        self.index, self.handle, self.detokenizer, self.stops, self.eos = index, handle, detokenizer, stops, eos
        self.logprobs = logprobs  # whether its tokens' log-probabilities are shown
        self.tokens: list[int] = []
        self.finish_reason: str | None = None
        self.chars = 0  # text of the tokens whose log-probabilities were shown (their offsets)

    async def pieces(self):
        """Yields `(text, token ids, the first one's position in tokens)` as the text becomes final;
        sets `finish_reason` at the end."""
        stream, ids, stopped = self.handle.astream(), [], False
        try:
            async for token in stream:
                self.tokens.append(token)
                ids.append(token)
                if token in self.eos:  # the token that ends the text is no part of it (as vLLM's stop_token_ids)
                    continue
                text, stopped = self.stops.feed(self.detokenizer.add(token))
                if stopped:
                    break
                if text:
                    yield text, ids, len(self.tokens) - len(ids)
                    ids = []
        except Overloaded as error:  # shed while it waited (the load controller turned it away)
            raise rate_limited(error) from error
        except RequestFailed as error:
            raise APIError(500, str(error), kind="server_error") from error
        finally:
            await stream.aclose()
            if not self.handle.done:  # a stop string matched (finished), or the reader went away
                self.handle.finish() if stopped else self.handle.cancel()
        if not stopped:
            text, stopped = self.stops.feed(self.detokenizer.advance(final=True))
            text += "" if stopped else self.stops.flush()
        self.finish_reason = "stop" if stopped else self.reason()
        if text or ids:
            yield text, ids, len(self.tokens) - len(ids)

    def reason(self) -> str:
        if self.handle.outcome != "finished":
            raise APIError(503, "the request was cancelled: the server is shutting down", kind="server_error")
        return "stop" if self.tokens and self.tokens[-1] in self.eos else "length"


# ------------------------------------------------------------------------- response formats
@dataclass
class TokenLogprob:
    """One generated token's log-probability, as the formats show it."""

    text: str
    logprob: float
    top: list[tuple[str, float]]  # the likeliest tokens' text and log-probability
    offset: int  # where its text starts in the completion (the completions API's text_offset)


class TextFormat:
    object, chunk_object, id_prefix = "text_completion", "text_completion", "cmpl-"

    def start(self, index: int) -> dict | None:
        return None

    def delta(self, index: int, text: str, finish: str | None, ids: list[int] | None, logprobs=None) -> dict:
        return self.final(index, text, finish, ids, logprobs)

    def final(self, index: int, text: str, finish: str | None, ids: list[int] | None, logprobs=None,
              calls: list[dict] = ()) -> dict:
        choice = {"index": index, "text": text, "logprobs": None if logprobs is None else self.logprobs(logprobs),
                  "finish_reason": finish}
        return choice if ids is None else choice | {"token_ids": ids}

    @staticmethod
    def logprobs(entries: list[TokenLogprob]) -> dict:
        """The completions API's shape: parallel lists, and each token's offset in the text."""
        return {"tokens": [e.text for e in entries], "token_logprobs": [e.logprob for e in entries],
                "top_logprobs": [{text: logprob for text, logprob in e.top} for e in entries],
                "text_offset": [e.offset for e in entries]}


class ChatFormat:
    object, chunk_object, id_prefix = "chat.completion", "chat.completion.chunk", "chatcmpl-"

    @staticmethod
    def calls_delta(index: int, calls: list[dict]) -> dict:
        """A choice's tool calls in one delta, each whole, as OpenAI's stream may send them."""
        return {"index": index, "delta": {"tool_calls": [{"index": k} | call for k, call in enumerate(calls)]},
                "logprobs": None, "finish_reason": None}

    @staticmethod
    def logprobs(entries: list[TokenLogprob]) -> dict:
        """The chat API's shape: per token its text, UTF-8 bytes, log-probability and alternatives."""
        def one(text: str, logprob: float) -> dict:
            return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

        return {"content": [one(e.text, e.logprob) | {"top_logprobs": [one(t, lp) for t, lp in e.top]}
                            for e in entries], "refusal": None}

    def start(self, index: int) -> dict | None:
        return {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                "finish_reason": None}

    def delta(self, index: int, text: str, finish: str | None, ids: list[int] | None, logprobs=None) -> dict:
        choice = {"index": index, "delta": {"content": text} if text or not finish else {},
                  "logprobs": None if logprobs is None else self.logprobs(logprobs), "finish_reason": finish}
        return choice if ids is None else choice | {"token_ids": ids}

    def final(self, index: int, text: str | None, finish: str | None, ids: list[int] | None, logprobs=None,
              calls: list[dict] = ()) -> dict:
        message = {"role": "assistant", "content": text} | ({"tool_calls": list(calls)} if calls else {})
        choice = {"index": index, "message": message,
                  "logprobs": None if logprobs is None else self.logprobs(logprobs), "finish_reason": finish}
        return choice if ids is None else choice | {"token_ids": ids}


def sse(payload: dict | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


class EventStream(StreamingResponse):
    """Server-sent events that cancel their request however the response ends."""

    def __init__(self, content, handles):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.handles = handles

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            cancel(self.handles)
            try:
                await self.body_iterator.aclose()
            except Exception:  # noqa: BLE001 - the client is gone; nothing left to tell it
                pass


async def disconnected(request: Request) -> None:
    """Returns when the client of a request whose body was read goes away."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def cancel(handles) -> None:
    for handle in handles:
        if not handle.done:
            handle.cancel()


async def watched(request: Request, generations: list[Generation], work) -> tuple[bool, Any]:
    """Awaits `work` unless the client goes away first, which cancels the requests:
    `(True, result)` or `(False, None)`."""
    task, watch = asyncio.ensure_future(work), asyncio.ensure_future(disconnected(request))
    try:
        done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
            cancel(g.handle for g in generations)
    return (True, task.result()) if task in done else (False, None)


async def each(generations: list[Generation], work) -> list:
    """`work(generation)` for every choice at once, in order; the first to fail cancels the others'
    requests and its error is raised (a request shed while it waited: the whole answer is a 429)."""
    tasks = [asyncio.ensure_future(work(g)) for g in generations]
    try:
        done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    except asyncio.CancelledError:
        for task in tasks:
            task.cancel()
        raise
    failed = next((t.exception() for t in tasks if t in done and t.exception() is not None), None)
    if failed is not None:
        cancel(g.handle for g in generations)
        await asyncio.gather(*pending, return_exceptions=True)
        raise failed
    return [task.result() for task in tasks]


async def first_piece(pieces) -> tuple[str, list[int], int] | None:
    try:
        return await pieces.__anext__()
    except StopAsyncIteration:
        return None


async def collect(generation: Generation) -> str:
    return "".join([text async for text, *_ in generation.pieces()])


# ------------------------------------------------------------------------------- the endpoints
class OpenAIServer:
    """The endpoints' work: prompts to token ids, OpenAI's parameters to the engine's, the
    engine's tokens to OpenAI's responses (whole or as server-sent events)."""

    def __init__(self, engine, model_name: str, default_max_tokens: int | None = None, trust_headers: bool = False):
        self.engine, self.model_name, self.tokenizer = engine, model_name, engine.tokenizer
        self.trust_headers = trust_headers
        # what one request may hold: the model's context, or less where the engine serves less
        limits = [n for n in (getattr(engine.model.config, "max_position_embeddings", None), engine.max_model_len)
                  if n is not None]
        self.context = min(limits) if limits else None
        self.vocab_size = engine.model.get_input_embeddings().num_embeddings
        self.default_max_tokens = default_max_tokens
        self.created = int(time.time())
        # Prompts are tokenized on worker threads, one at a time: a fast tokenizer's first call may
        # switch off the padding or truncation it was saved with, and that change must not meet
        # another call – made here, before any request, so the decodes on the event loop never do.
        self.tokenizing = threading.Lock()
        try:
            if self.tokenizer is not None:
                self.tokenizer.encode("")
        except Exception:  # noqa: BLE001 - a tokenizer that refuses empty text settles at its first prompt
            pass

    # ------------------------------------------------------------------ prompts
    def check_model(self, name: str) -> None:
        if name != self.model_name:
            raise APIError(404, f"The model `{name}` does not exist: this server serves `{self.model_name}`",
                           param="model", code="model_not_found")

    def completion_prompts(self, prompt) -> list[list[int]]:
        """A completion's prompts: one (text or token ids) or a list of them, one choice each."""
        batch = prompt if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int) else [prompt]
        if len(batch) > MAX_CHOICES:
            raise invalid(f"at most {MAX_CHOICES} prompts per request, got {len(batch)}", "prompt")
        prompts = []
        for one in batch:
            ids = self.tokenize(one, special=True) if isinstance(one, str) else list(one)
            self.check_vocabulary(ids, "prompt")
            if not ids:
                raise invalid("the prompt is empty" if len(batch) == 1 else f"prompt {len(prompts)} is empty",
                              "prompt")
            prompts.append(ids)
        return prompts

    def check_vocabulary(self, ids: list[int], field: str) -> None:
        out_of_range = [t for t in ids if not 0 <= t < self.vocab_size]
        if out_of_range:
            raise invalid(f"token ids {out_of_range[:5]} are outside the vocabulary (0..{self.vocab_size - 1})",
                          field)

    def chat_prompt(self, messages: list[dict], tools: Tools | None = None) -> list[int]:
        """The prompt of a conversation, through the model's chat template, with the tools a
        call may use (see `tools`)."""
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise invalid("this model's tokenizer has no chat template: use /v1/completions", "messages")
        if not messages:
            raise invalid("messages is empty", "messages")
        rendered = [chat_message(m, i) for i, m in enumerate(messages)]
        options = {}
        if knows_tools(self.tokenizer.chat_template):
            for message in rendered:  # as transformers' templates take past calls
                if "tool_calls" in message:
                    message["tool_calls"] = [{"id": c["id"], "type": "function", "function": {
                        "name": c["name"], "arguments": c["arguments"]}} for c in message["tool_calls"]]
            options = {"tools": tools.template_tools()} if tools is not None else {}
        elif tools is not None or any(m["role"] == "tool" or "tool_calls" in m for m in rendered):
            rendered = hermes_messages(rendered, tools)
        try:
            with self.tokenizing:
                text = self.tokenizer.apply_chat_template(rendered, add_generation_prompt=True, tokenize=False,
                                                          **options)
        except Exception as error:  # noqa: BLE001 - templates raise what they like (role order, ...)
            raise invalid(f"the chat template refused these messages: {error}", "messages") from error
        return self.tokenize(text, special=False)  # the template already holds the special tokens

    def tokenize(self, text: str, special: bool) -> list[int]:
        if self.tokenizer is None:
            raise invalid("this server has no tokenizer: send the prompt as a list of token ids", "prompt")
        with self.tokenizing:
            return [int(t) for t in self.tokenizer.encode(text, add_special_tokens=special)]

    # --------------------------------------------------------------- parameters
    def sampling(self, body: GenerationRequest, prompt_length: int, max_tokens: int) -> dict:
        """The engine's `submit` arguments for these OpenAI parameters (400 on a bad one)."""
        temperature = 1.0 if body.temperature is None else body.temperature
        if not 0 <= temperature <= 2:
            raise invalid(f"temperature must be in [0, 2], got {temperature}", "temperature")
        top_p = 1.0 if body.top_p is None else body.top_p
        if not 0 < top_p <= 1:
            raise invalid(f"top_p must be in (0, 1], got {top_p}", "top_p")
        top_k = 0 if body.top_k in (None, -1) else body.top_k
        if top_k < 0:
            raise invalid(f"top_k must be >= 0 (0 or -1: off), got {top_k}", "top_k")
        if body.seed is not None and not -(2**63) <= body.seed < 2**64:  # OpenAI's are int64 (-1 is common)
            raise invalid(f"seed must be a 64-bit integer, got {body.seed}", "seed")
        if body.stream_options is not None and not body.stream:
            raise invalid("stream_options is only allowed when stream is true", "stream_options")
        self.check_length(prompt_length, max_tokens, body)
        return dict(max_new_tokens=max_tokens, do_sample=temperature > 0, temperature=temperature or 1.0,
                    top_p=top_p, top_k=top_k, seed=body.seed, eos_token_id=self.end_tokens(body),
                    **self.penalties(body, max_tokens))

    def penalties(self, body: GenerationRequest, max_tokens: int) -> dict:
        """The engine's penalty, bias, min-p and min-tokens arguments (400 on a bad one)."""
        found = {}
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(body, name)
            if value is not None and not -MAX_PENALTY <= value <= MAX_PENALTY:
                raise invalid(f"{name} must be in [-{MAX_PENALTY}, {MAX_PENALTY}], got {value}", name)
            found[name] = value or 0.0
        repetition = 1.0 if body.repetition_penalty is None else body.repetition_penalty
        if not (math.isfinite(repetition) and repetition > 0):
            raise invalid(f"repetition_penalty must be > 0 (1: off), got {repetition}", "repetition_penalty")
        min_p = 0.0 if body.min_p is None else body.min_p
        if not 0 <= min_p <= 1:
            raise invalid(f"min_p must be in [0, 1] (0: off), got {min_p}", "min_p")
        min_tokens = body.min_tokens or 0
        if not 0 <= min_tokens <= max_tokens:
            raise invalid(f"min_tokens must be in [0, {body.max_tokens_field()}={max_tokens}], got {min_tokens}",
                          "min_tokens")
        alternatives, field = body.alternatives()
        if alternatives is not None and not 0 <= alternatives <= MAX_LOGPROBS:
            raise invalid(f"{field} must be in [0, {MAX_LOGPROBS}], got {alternatives}", field)
        return found | dict(repetition_penalty=repetition, min_p=min_p, min_tokens=min_tokens,
                            logit_bias=self.logit_bias(body.logit_bias or {}), logprobs=alternatives,
                            **structured(body.response_format))

    def token_logprobs(self, generation: Generation, start: int, count: int) -> list[TokenLogprob] | None:
        """The log-probabilities of `count` tokens from `start` of a choice that asked for them."""
        if not generation.logprobs:
            return None
        request, entries = generation.handle.request, []
        for position in range(start, start + count):
            logprob, top = request.logprobs[position]
            text = self.token_text(generation.tokens[position])
            entries.append(TokenLogprob(text, logprob, [(self.token_text(t), value) for t, value in top],
                                        generation.chars))
            generation.chars += len(text)
        return entries

    def echoed(self, ids: list[int]) -> str:
        """A prompt as `echo` shows it: its text (nothing without a tokenizer)."""
        return "" if self.tokenizer is None else self.tokenizer.decode(ids)

    def token_text(self, token: int) -> str:
        """A token as the log-probabilities name it: its text, or `token_id:N` without a tokenizer."""
        return f"token_id:{token}" if self.tokenizer is None else self.tokenizer.decode([token])

    def logit_bias(self, bias: dict[str, float]) -> dict[int, float]:
        """OpenAI's `logit_bias`: token ids (as JSON keys, so text) to biases in [-100, 100]."""
        tokens = {}
        for key, value in bias.items():
            try:
                token = int(key)
            except ValueError:
                raise invalid(f"logit_bias keys must be token ids, got {key[:40]!r}", "logit_bias") from None
            if not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
                raise invalid(f"logit_bias values must be in [-{MAX_LOGIT_BIAS}, {MAX_LOGIT_BIAS}], got {value} "
                              f"for token {token}", "logit_bias")
            tokens[token] = value
        self.check_vocabulary(list(tokens), "logit_bias")
        return tokens

    def end_tokens(self, body: GenerationRequest) -> list[int]:
        """The tokens that end the text: the model's EOS (unless `ignore_eos`) and `stop_token_ids`."""
        stop_ids = body.stop_token_ids or []
        self.check_vocabulary(stop_ids, "stop_token_ids")
        return ([] if body.ignore_eos else list(self.engine.eos)) + stop_ids

    def check_length(self, prompt_length: int, max_tokens: int, body: GenerationRequest) -> None:
        tokens_field = body.max_tokens_field()
        if max_tokens < 1:
            raise invalid(f"{tokens_field} must be at least 1, got {max_tokens}", tokens_field)
        total = prompt_length + max_tokens
        asked = f"{total} tokens ({prompt_length} in the prompt, {max_tokens} for the completion)"
        if self.context is not None and total > self.context:
            field, advice = blame(body, prompt_length, self.context)
            raise invalid(f"This model's maximum context length is {self.context} tokens. However, you requested "
                          f"{asked}. Please {advice}.", field, "context_length_exceeded")
        pool = self.engine.pool
        if total > pool.num_blocks * pool.block_size:
            field, advice = blame(body, prompt_length, pool.num_blocks * pool.block_size)
            raise invalid(f"{asked} need more KV blocks than the server's pool holds ({pool.num_blocks} of "
                          f"{pool.block_size} tokens): {advice}", field, "kv_pool_too_small")

    def stop_strings(self, stop) -> list[str]:
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if len(stops) > MAX_STOP_STRINGS:
            raise invalid(f"at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}", "stop")
        longest = max(map(len, stops), default=0)
        if longest > MAX_STOP_LENGTH:
            raise invalid(f"a stop string may hold at most {MAX_STOP_LENGTH} characters, got {longest}", "stop")
        if stops and self.tokenizer is None:
            raise invalid("stop strings need a tokenizer, which this server lacks", "stop")
        return stops

    def chat_max_tokens(self, body: ChatRequest, prompt_length: int) -> int:
        asked = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        if asked is not None:
            return asked
        pool = self.engine.pool
        fits = pool.num_blocks * pool.block_size  # what one request can hold, when less than the context
        room = min(self.context if self.context is not None else 256 + prompt_length, fits) - prompt_length
        if room < 1:
            where = "context" if self.context is not None and prompt_length >= self.context else "KV pool"
            raise invalid(f"the prompt alone ({prompt_length} tokens) fills the {where} ({prompt_length + room} tokens "
                          "a request can hold): shorten the messages", "messages",
                          "context_length_exceeded" if where == "context" else "kv_pool_too_small")
        return min(room, self.default_max_tokens) if self.default_max_tokens else room

    def who(self, request: Request, body: GenerationRequest) -> tuple[str, int]:
        """The tenant and priority: the X-Tenant and X-Priority headers where the operator trusts
        them (`trust_headers`: a proxy in front sets them), else "default" and 0; with a
        `cache_salt`, that tenant and the salt together."""
        headers = request.headers if self.trust_headers else {}
        tenant = headers.get("x-tenant") or "default"
        if body.cache_salt is not None:
            if not body.cache_salt:
                raise invalid("cache_salt must not be empty", "cache_salt")
            tenant = json.dumps([tenant, body.cache_salt])  # a name of its own: reuse only with the same salt
        try:
            priority = int(headers.get("x-priority", "0"))
        except ValueError:
            raise invalid("the X-Priority header must be an integer", "X-Priority") from None
        return tenant, priority

    def submit(self, ids: list[int], params: dict, tenant: str, priority: int):
        try:
            return self.engine.submit(ids, tenant=tenant, priority=priority, **params)
        except Overloaded as error:
            raise rate_limited(error) from error
        except GrammarError as error:
            raise invalid(str(error), "response_format") from error
        except ValueError as error:
            raise invalid(str(error)) from error
        except PagedKVError as error:
            raise APIError(503, str(error), kind="server_error", code="engine_unavailable") from error

    # ---------------------------------------------------------------- responses
    def choices_per_prompt(self, body: GenerationRequest, prompts: int) -> tuple[int, int]:
        """`(n, best_of)`: the choices returned per prompt, and the samples drawn for them."""
        n = 1 if body.n is None else body.n
        if n < 1:
            raise invalid(f"n must be at least 1, got {n}", "n")
        best_of = getattr(body, "best_of", None) or n
        if best_of < n:
            raise invalid(f"best_of must be at least n={n}, got {best_of}", "best_of")
        if best_of > n and body.stream:
            raise invalid("best_of > n cannot be streamed (the best are known only at the end)", "best_of")
        if best_of * prompts > MAX_CHOICES:
            field = "best_of" if best_of > n else "n"
            raise invalid(f"at most {MAX_CHOICES} choices per request, got {prompts} prompt(s) x {field}={best_of}",
                          field)
        return n, best_of

    def submit_choices(self, body: GenerationRequest, prompts: list[list[int]], contexts: list[list[int]],
                       max_tokens: int, tenant: str, priority: int, constraint: dict) -> list[Generation]:
        """Submit `best_of` (else `n`) samples per prompt (index: prompt's position x samples +
        sample): sample k > 0 of a seeded request is seeded `seed + k`. The samples of one prompt
        share its cached blocks (the first prefill's full blocks, which the others wait for and
        inherit). One refused submit cancels the samples already submitted."""
        (n, best_of), stops = self.choices_per_prompt(body, len(prompts)), self.stop_strings(body.stop)
        generations: list[Generation] = []
        try:
            for ids, context in zip(prompts, contexts):
                params = self.sampling(body, len(ids), max_tokens) | constraint  # a forced tool call's grammar
                shown = params["logprobs"] is not None
                if best_of > n and not shown:  # the ranking needs each token's log-probability
                    params["logprobs"] = 0
                for k in range(best_of):
                    seed = params["seed"]
                    seeded = params | ({"seed": seed + k if seed + k < 2**64 else seed - k} if seed is not None else {})
                    generations.append(Generation(
                        len(generations), self.submit(ids, seeded, tenant, priority),
                        Detokenizer(self.tokenizer, context, body.skip_special_tokens is not False),
                        StopMatcher(stops, bool(body.include_stop_str_in_output)), set(params["eos_token_id"]),
                        shown))
        except APIError:
            cancel(g.handle for g in generations)
            raise
        return generations

    async def respond(self, request: Request, body: GenerationRequest, prompts: list[list[int]], fmt,
                      max_tokens: int, contexts: list[list[int]], tools: Tools | None = None):
        # on a worker thread: compiling a new JSON schema takes milliseconds the other streams need
        forced = {"json_schema": tools.schema(), "strict": True} if tools is not None and tools.forced else {}
        generations = await asyncio.to_thread(self.submit_choices, body, prompts, contexts, max_tokens,
                                              *self.who(request, body), forced)
        meta = {"id": fmt.id_prefix + uuid.uuid4().hex, "created": int(time.time()), "model": self.model_name}
        per_prompt = len(generations) // len(prompts)
        if body.stream:
            # The status line waits for every choice's first piece: a request shed or failed before
            # its first token is answered with its own status (429, 500), not a 200 that breaks off.
            streams = [g.pieces() for g in generations]
            arrived, firsts = await watched(request, generations,
                                            each(generations, lambda g: first_piece(streams[g.index])))
            if not arrived:
                return Response(status_code=499)  # the client went away: nobody to answer
            return EventStream(self.events(generations, streams, firsts, fmt, meta, prompts, body, tools),
                               [g.handle for g in generations])
        arrived, texts = await watched(request, generations, each(generations, collect))
        if not arrived:
            return Response(status_code=499)
        with_ids = bool(body.return_token_ids)
        choices = []
        for index, (g, text) in enumerate(best(generations, texts, len(prompts), body.n or 1)):
            text, calls, finish = called(tools, text, g.finish_reason)
            if getattr(body, "echo", False):
                text = self.echoed(prompts[g.index // per_prompt]) + text
            choice = fmt.final(index, text, finish, g.tokens if with_ids else None,
                               self.token_logprobs(g, 0, len(g.tokens)), calls)
            if with_ids and len(prompts) > 1:
                choice["prompt_token_ids"] = prompts[g.index // per_prompt]
            choices.append(choice)
        answer = meta | {"object": fmt.object, "choices": choices, "usage": usage(prompts, generations)}
        return JSONResponse(answer | ({"prompt_token_ids": prompts[0]} if with_ids and len(prompts) == 1 else {}))

    async def events(self, generations: list[Generation], streams, firsts, fmt, meta: dict,
                     prompts: list[list[int]], body: GenerationRequest, tools: Tools | None = None):
        """The choices' chunks as their pieces come (each names its choice's index), then the
        usage chunk when asked, then `[DONE]`. With tools, a choice's text is held until it ends
        (a call is known only then): its content, then its calls, come in its last chunks."""
        want_usage = bool(body.stream_options and body.stream_options.include_usage)
        every_chunk = want_usage and body.stream_options.continuous_usage_stats  # vLLM's: usage so far
        with_ids, opening = bool(body.return_token_ids), [True]

        def chunk(choices: list[dict], **extra) -> str:
            payload = meta | {"object": fmt.chunk_object, "choices": choices} | extra
            if want_usage:
                payload.setdefault("usage", usage(prompts, generations) if every_chunk else None)
            if with_ids and opening[0]:
                payload["prompt_token_ids"], opening[0] = (prompts[0] if len(prompts) == 1 else prompts), False
            return sse(payload)

        pieces: asyncio.Queue = asyncio.Queue()

        async def pump(generation: Generation, stream) -> None:
            try:
                async for text, ids, at in stream:
                    await pieces.put((generation, text, ids, at))
                await pieces.put((generation, None, None, 0))
            except Exception as error:  # noqa: BLE001 - told to the client below
                await pieces.put((generation, error, None, 0))

        pumps = []
        try:
            held = {g.index: "" for g in generations}  # with tools: each choice's text so far

            def piece(g: Generation, text: str, ids: list[int], at: int) -> str | None:
                if tools is not None:
                    held[g.index] += text
                    text = ""
                if not text and not ids:
                    return None
                return chunk([fmt.delta(g.index, text, None, ids if with_ids else None,
                                        self.token_logprobs(g, at, len(ids)))])

            per_prompt = len(generations) // len(prompts)
            for g, first in zip(generations, firsts):
                if (start := fmt.start(g.index)) is not None:
                    yield chunk([start])
                if getattr(body, "echo", False):
                    yield chunk([fmt.delta(g.index, self.echoed(prompts[g.index // per_prompt]), None, None)])
                if first is not None and (event := piece(g, *first)) is not None:
                    yield event
            pumps = [asyncio.ensure_future(pump(g, stream)) for g, stream in zip(generations, streams)]
            for _ in generations:  # until every choice has finished
                while True:
                    g, text, ids, at = await pieces.get()
                    if isinstance(text, Exception):
                        raise text
                    if text is None:
                        break
                    if (event := piece(g, text, ids, at)) is not None:
                        yield event
                finish = g.finish_reason
                if tools is not None:
                    content, calls, finish = called(tools, held[g.index], finish)
                    if content:
                        yield chunk([fmt.delta(g.index, content, None, None)])
                    if calls:
                        yield chunk([fmt.calls_delta(g.index, calls)])
                yield chunk([fmt.delta(g.index, "", finish, [] if with_ids else None)])
            if want_usage:
                yield chunk([], usage=usage(prompts, generations))
        except APIError as error:
            yield sse(error.body())
        except Exception as error:  # noqa: BLE001 - the status line is gone: the stream says what failed
            yield sse(APIError(500, f"generation failed: {error!r}", kind="server_error").body())
        finally:
            for task in pumps:
                task.cancel()
        yield sse("[DONE]")


def best(generations: list[Generation], texts: list[str], prompts: int, n: int) -> list[tuple[Generation, str]]:
    """Per prompt, its `n` samples of the highest total log-probability, likeliest first (all of
    them, in order, when no more than `n` were drawn)."""
    drawn = len(generations) // prompts
    pairs = list(zip(generations, texts))
    if drawn == n:
        return pairs

    def likelihood(pair) -> float:
        return sum(logprob for logprob, _ in pair[0].handle.request.logprobs)

    return [pair for k in range(prompts)
            for pair in sorted(pairs[k * drawn:(k + 1) * drawn], key=likelihood, reverse=True)[:n]]


def called(tools: Tools | None, text: str, finish: str | None) -> tuple[str | None, list[dict], str | None]:
    """`(content, tool calls, finish reason)` of a choice's text: "tool_calls" when it called any."""
    if tools is None:
        return text, [], finish
    content, calls = tools.calls(text)
    return content, calls, "tool_calls" if calls else finish


def structured(response_format: dict | None) -> dict:
    """The engine's structured-output arguments for OpenAI's `response_format`."""
    kind = (response_format or {"type": "text"}).get("type")
    if kind == "text":
        return {}
    if kind == "json_object":
        return {"json_schema": True}
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise invalid("response_format.json_schema.schema must be a JSON schema (an object)", "response_format")
        return {"json_schema": spec["schema"], "strict": spec.get("strict") is True}  # OpenAI: false by default
    raise invalid(f"response_format.type must be text, json_object or json_schema, got {kind!r}", "response_format")


def blame(body: GenerationRequest, prompt_length: int, capacity: int) -> tuple[str, str]:
    """(the field to name, the advice) for a request over `capacity` tokens: the prompt when it
    alone leaves no room for a single token, else the field that set the completion's length."""
    if prompt_length >= capacity:
        return body.prompt_field, f"shorten the {body.prompt_field}"
    return body.max_tokens_field(), f"reduce {body.max_tokens_field()}"


def chat_message(message: dict, index: int) -> dict:
    """One OpenAI chat message as the chat template expects it: a role and a string content (and
    its `name`, for templates that show it); an assistant's `tool_calls` with their arguments as
    objects, a tool message's `tool_call_id`."""
    where = f"messages[{index}]"
    role, content = message.get("role"), message.get("content")
    role = "system" if role == "developer" else role
    if role not in ("system", "user", "assistant", "tool"):
        raise invalid(f"{where}.role must be system, developer, user, assistant or tool, got {role!r}",
                      f"{where}.role")
    calls = message.get("tool_calls") if role == "assistant" else None
    if calls and content is None:
        content = ""  # an answer that only called tools
    # history sent back as the client received it (`ChatCompletionMessage.model_dump()`) holds
    # the fields of an answer this server never gives, empty: those say nothing, and are dropped
    known = ("role", "content", "name", "tool_calls", "tool_call_id")
    unsupported = sorted(k for k, v in message.items() if k not in known and v not in EMPTY_VALUES)
    if unsupported:
        raise invalid(f"{where} has fields this server does not support: {unsupported}",
                      f"{where}.{unsupported[0]}")
    if isinstance(content, list):
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                   for p in content):
            raise invalid(f"{where}.content: only text parts are supported", f"{where}.content")
        content = "\n".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise invalid(f"{where}.content must be a string or a list of text parts", f"{where}.content")
    name = message.get("name")
    if name is not None and not isinstance(name, str):
        raise invalid(f"{where}.name must be a string", f"{where}.name")
    rendered = {"role": role, "content": content} | ({"name": name} if name else {})
    if role == "tool":
        return rendered | {"tool_call_id": str(message.get("tool_call_id") or "")}
    return rendered | ({"tool_calls": [tool_call(c, f"{where}.tool_calls[{i}]") for i, c in enumerate(calls)]}
                       if calls else {})


def tool_call(call, where: str) -> dict:
    """A past call as chat templates take it: `{"name", "arguments": {...}}`, its id kept."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise invalid(f"{where} must be {{'type': 'function', 'function': {{'name', 'arguments'}}}}", where)
    try:
        arguments = json.loads(function.get("arguments") or "{}")
    except (TypeError, json.JSONDecodeError):
        arguments = None
    if not isinstance(arguments, dict):
        raise invalid(f"{where}.function.arguments must be a JSON object (as text)", where)
    return {"id": call.get("id"), "name": function["name"], "arguments": arguments}


def usage(prompts: list[list[int]], generations: list[Generation]) -> dict:
    """OpenAI's usage: each prompt counted once, whatever its `n`; `cached_tokens`: per prompt, the
    prompt tokens whose KV its first sample's admission found cached (the other samples wait for
    and share what that one computes)."""
    per_prompt = len(generations) // len(prompts)
    prompt = sum(map(len, prompts))
    completion = sum(len(g.tokens) for g in generations)
    cached = sum(min(generations[i * per_prompt].handle.request.inherited, len(ids)) for i, ids in enumerate(prompts))
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


# ------------------------------------------------------------------------------------ the app
def create_app(engine, model_name: str, *, default_max_tokens: int | None = None, api_key: str | None = None,
               trust_headers: bool = False) -> FastAPI:
    """The OpenAI-compatible app on `engine` (started and stopped with the app), serving
    `model_name`. `default_max_tokens` caps a chat completion without `max_tokens` (by default
    it may fill the model's context, as OpenAI's does); completions default to 16, as OpenAI's.
    With `api_key`, every route but `/health`, `/metrics` and `/version` answers 401 without
    `Authorization: Bearer <api_key>`. `trust_headers` takes each request's tenant and priority
    from its X-Tenant and X-Priority headers: only behind a proxy that sets them."""
    server = OpenAIServer(engine, model_name, default_max_tokens, trust_headers)
    ignored: set[str] = set()  # the unknown fields logged so far

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        try:
            yield
        finally:  # connections are closed by now: whatever is left has nobody waiting for it
            await asyncio.to_thread(engine.stop, False)

    app = FastAPI(title="hf_paged_kv", lifespan=lifespan)
    app.state.engine, app.state.server = engine, server
    add_error_handlers(app)
    if api_key:
        require_api_key(app, api_key)
    add_request_ids(app)  # added last, so outermost: a 401 carries its request id too

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        check_extras(body, NEUTRAL_COMPLETION, ignored)
        server.check_model(body.model)
        # on a worker thread, as the chat's below: a huge prompt must not stall the other streams
        if body.echo and body.logprobs is not None:  # the prompt's own log-probabilities are not computed
            raise invalid("echo cannot go with logprobs: this server does not compute the prompt's log-probabilities",
                          "echo")
        prompts = await asyncio.to_thread(server.completion_prompts, body.prompt)
        max_tokens = 16 if body.max_tokens is None else body.max_tokens
        return await server.respond(request, body, prompts, TextFormat(), max_tokens,
                                    [ids[-DETOKENIZER_CONTEXT:] for ids in prompts])

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request):
        check_extras(body, NEUTRAL_CHAT, ignored)
        server.check_model(body.model)
        try:
            tools = Tools.of(body.tools, body.tool_choice)
        except ToolError as error:
            raise invalid(str(error), error.param) from None
        if tools is not None and tools.forced and body.response_format not in (None, {"type": "text"}):
            raise invalid("a response_format cannot go with a tool_choice that forces a call", "response_format")
        ids = await asyncio.to_thread(server.chat_prompt, body.messages, tools)
        return await server.respond(request, body, [ids], ChatFormat(), server.chat_max_tokens(body, len(ids)), [[]],
                                    tools)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        if body.model is not None:
            server.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise invalid("send either prompt or messages", "prompt")
        if body.messages is not None:
            ids = await asyncio.to_thread(server.chat_prompt, body.messages)
        else:
            ids = await asyncio.to_thread(server.tokenize, body.prompt, body.add_special_tokens)
        return {"count": len(ids), "max_model_len": server.context, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        if body.model is not None:
            server.check_model(body.model)
        server.check_vocabulary(body.tokens, "tokens")
        if server.tokenizer is None:
            raise invalid("this server has no tokenizer", "tokens")
        with server.tokenizing:
            return {"prompt": server.tokenizer.decode(body.tokens)}

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card(server)]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        server.check_model(model_id)
        return model_card(server)

    @app.get("/metrics")
    def metrics():  # not async: the pool's lock may be held by a step, and the event loop must not wait on it
        return Response(engine.prometheus(), media_type=PROMETHEUS_CONTENT_TYPE)

    @app.get("/health")
    async def health():
        alive = engine.thread is not None and engine.thread.is_alive() and engine.accepting
        return JSONResponse({"status": "ok" if alive else "stopped"}, status_code=200 if alive else 503)

    return app


def model_card(server: OpenAIServer) -> dict:
    card = {"id": server.model_name, "object": "model", "created": server.created, "owned_by": "hf_paged_kv"}
    return card | ({"max_model_len": server.context} if server.context is not None else {})


UNAUTHENTICATED = ("/health", "/metrics", "/version")  # open with an API key too, as in vLLM


def require_api_key(app: FastAPI, key: str) -> None:
    """401, in OpenAI's shape, for a request without `Authorization: Bearer <key>` (compared in
    constant time), on every route but `UNAUTHENTICATED`."""
    expected = f"Bearer {key}".encode()

    @app.middleware("http")
    async def authenticate(request: Request, call_next):
        given = request.headers.get("authorization", "").encode()
        if request.url.path not in UNAUTHENTICATED and not secrets.compare_digest(given, expected):
            return APIError(401, "Incorrect API key provided: send it as 'Authorization: Bearer <key>'",
                            code="invalid_api_key").response()
        return await call_next(request)


def add_request_ids(app: FastAPI) -> None:
    """Every response carries an `X-Request-Id`: the request's own, else a new one."""

    @app.middleware("http")
    async def request_id(request: Request, call_next):
        given = request.headers.get("x-request-id")
        response = await call_next(request)
        response.headers["X-Request-Id"] = given if given and len(given) <= 256 else uuid.uuid4().hex
        return response


def add_error_handlers(app: FastAPI) -> None:
    """Every error leaves in OpenAI's shape; a malformed body is a 400, as OpenAI answers it."""

    async def api_error(request: Request, error: APIError):
        return error.response()

    async def validation_error(request: Request, error: RequestValidationError):
        problems = error.errors()
        message = "; ".join(f"{located(p) or 'body'}: {p.get('msg')}" for p in problems)
        return invalid(f"invalid request: {message}", problem_field(problems[0]) if problems else None).response()

    async def http_error(request: Request, error: StarletteHTTPException):
        kind = "invalid_request_error" if error.status_code < 500 else "server_error"
        return APIError(error.status_code, str(error.detail), kind=kind, headers=error.headers).response()

    async def unexpected(request: Request, error: Exception):
        return APIError(500, f"internal error: {error!r}", kind="server_error").response()

    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(Exception, unexpected)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(StarletteHTTPException, http_error)


def located(problem: dict) -> str:
    """Where in the body a validation problem lies: a dotted path, or for malformed JSON the
    character where decoding failed."""
    where = ".".join(str(part) for part in problem.get("loc", ())[1:])
    return f"character {where}" if problem.get("type") == "json_invalid" else where


def problem_field(problem: dict) -> str | None:
    """The top-level field a validation problem is about (the message holds its full path,
    with a union's member tags that pydantic adds), or None for the body as a whole: malformed
    JSON, whose location is a character position, or a body that is no object."""
    path = problem.get("loc", ())[1:]
    return None if problem.get("type") == "json_invalid" or not path else str(path[0])
