"""An OpenAI-compatible HTTP server on the engine (the `serve` extra: FastAPI + uvicorn).

    >>> from hf_paged_kv.engine.server import create_app
    >>> app = create_app(Engine(model, tokenizer=tok, pool=KVPool(num_blocks=512)), "my-model")
    >>> uvicorn.run(app, port=8000)          # or: python -m hf_paged_kv.serve --model DIR

Routes: `POST /v1/completions`, `POST /v1/chat/completions` (both with `stream: true` as
server-sent events ending in `data: [DONE]`), `GET /v1/models`, `GET /metrics` (the engine's
Prometheus text), `GET /health`. The engine runs in this process: the app starts it when it
starts and stops it when it stops.

- `temperature: 0` is greedy; otherwise `temperature`, `top_p` (and the extension `top_k`)
  sample, reproducibly with `seed`. `n` must be 1. `stop` (up to 4 strings) ends the text before
  the first match. Extensions as in vLLM: `ignore_eos`, `return_token_ids` (the token ids of the
  prompt and of each choice, or of each chunk's text).
- A field this server does not implement is refused with a 400 in OpenAI's error shape, unless
  it carries its neutral value (`frequency_penalty: 0`, `logit_bias: {}`, ...), as many clients
  send those by default. Unknown fields are refused too.
- The tenant of a request (whose cached KV it may reuse) is the `X-Tenant` header, else the
  `user` field, else "default"; `X-Priority` (an int) sets its scheduling priority.
- When the engine sheds load the answer is 429 with `Retry-After` (whole seconds, rounded up).
- A client that disconnects, streaming or not, cancels its request; the engine frees its blocks.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
import uuid
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..errors import Overloaded, PagedKVError
from .request import RequestFailed

PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
MAX_STOP_STRINGS = 4
DETOKENIZER_CONTEXT = 5  # prompt tokens decoded with a completion's first tokens (leading spaces)
ANY = object()

# Fields of OpenAI's API this server does not implement, with the values that mean "off".
NEUTRAL_COMMON = {"frequency_penalty": (None, 0), "presence_penalty": (None, 0), "logit_bias": (None, {}),
                  "service_tier": (None, "auto", "default"), "store": (None, False), "metadata": ANY}
NEUTRAL_COMPLETION = NEUTRAL_COMMON | {"best_of": (None, 1), "echo": (None, False), "logprobs": (None,),
                                       "suffix": (None, "")}
NEUTRAL_CHAT = NEUTRAL_COMMON | {
    "logprobs": (None, False), "top_logprobs": (None, 0), "tools": (None, []), "tool_choice": (None, "none", "auto"),
    "parallel_tool_calls": (None, True, False), "functions": (None, []), "function_call": (None, "none", "auto"),
    "response_format": (None, {"type": "text"}), "modalities": (None, ["text"]), "audio": (None,),
    "prediction": (None,), "reasoning_effort": (None,), "web_search_options": (None,)}


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


# ---------------------------------------------------------------------------- request bodies
class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class GenerationRequest(BaseModel):
    """The fields both endpoints share; anything else lands in `model_extra` and is checked."""

    model_config = ConfigDict(extra="allow")
    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # extension (vLLM): 0 or -1 is off
    n: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    user: str | None = None
    ignore_eos: bool = False  # extension (vLLM)
    return_token_ids: bool = False  # extension (vLLM)


class CompletionRequest(GenerationRequest):
    prompt: str | list[int] | list[str] | list[list[int]]


class ChatRequest(GenerationRequest):
    messages: list[dict[str, Any]]
    max_completion_tokens: int | None = None


def check_extras(body: GenerationRequest, neutral: dict) -> None:
    for name, value in (body.model_extra or {}).items():
        if name not in neutral:
            raise invalid(f"Unrecognized request argument supplied: {name}", param=name)
        allowed = neutral[name]
        if allowed is not ANY and not any(value == v for v in allowed):
            shown = " or ".join(json.dumps(v) for v in allowed)
            raise invalid(f"'{name}' is not supported by this server (hf_paged_kv); omit it or send {shown}",
                          param=name, code="unsupported_parameter")


# -------------------------------------------------------------------------------- text output
class Detokenizer:
    """Token ids to text as they come, never splitting a multi-byte character: each new piece is
    the decoded tail of a short window minus the decoded window before it (as TGI and vLLM do).
    `context` (the prompt's last tokens) makes a completion's first piece carry its leading space."""

    def __init__(self, tokenizer, context: list[int] = ()):
        self.tokenizer = tokenizer
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
        return self.tokenizer.decode(ids, skip_special_tokens=True) if ids else ""


class StopMatcher:
    """Holds back text that may begin a stop string; reports the first stop string met."""

    def __init__(self, stops: list[str]):
        self.stops, self.pending = [s for s in stops if s], ""

    def feed(self, text: str) -> tuple[str, bool]:
        """(text safe to emit, whether a stop string was met: the text then ends before it)."""
        self.pending += text
        hits = [self.pending.find(s) for s in self.stops if s in self.pending]
        if hits:
            emit, self.pending = self.pending[: min(hits)], ""
            return emit, True
        hold = max((k for s in self.stops for k in range(1, len(s)) if self.pending.endswith(s[:k])), default=0)
        emit, self.pending = self.pending[: len(self.pending) - hold], self.pending[len(self.pending) - hold:]
        return emit, False

    def flush(self) -> str:
        emit, self.pending = self.pending, ""
        return emit


class Generation:
    """One request's tokens as text pieces, its finish reason, and its cancellation when the
    reader goes away (a disconnected client) or a stop string ends it early."""

    def __init__(self, handle, detokenizer: Detokenizer, stops: StopMatcher, eos: set[int]):
        self.handle, self.detokenizer, self.stops, self.eos = handle, detokenizer, stops, eos
        self.tokens: list[int] = []
        self.finish_reason: str | None = None

    async def pieces(self):
        """Yields `(text, token ids)` as the text becomes final; sets `finish_reason` at the end."""
        stream, ids, stopped = self.handle.astream(), [], False
        try:
            async for token in stream:
                self.tokens.append(token)
                ids.append(token)
                text, stopped = self.stops.feed(self.detokenizer.add(token))
                if stopped:
                    break
                if text:
                    yield text, ids
                    ids = []
        except RequestFailed as error:
            raise APIError(500, str(error), kind="server_error") from error
        finally:
            await stream.aclose()
            if not self.handle.done:
                self.handle.cancel()
        if not stopped:
            text, stopped = self.stops.feed(self.detokenizer.advance(final=True))
            text += "" if stopped else self.stops.flush()
        self.finish_reason = "stop" if stopped else self.reason()
        if text or ids:
            yield text, ids

    def reason(self) -> str:
        if self.handle.outcome != "finished":
            raise APIError(503, "the request was cancelled: the server is shutting down", kind="server_error")
        return "stop" if self.tokens and self.tokens[-1] in self.eos else "length"


# ------------------------------------------------------------------------- response formats
class TextFormat:
    object, chunk_object, id_prefix = "text_completion", "text_completion", "cmpl-"

    def start(self) -> dict | None:
        return None

    def delta(self, text: str, finish: str | None, ids: list[int] | None) -> dict:
        return self.final(text, finish, ids)

    def final(self, text: str, finish: str | None, ids: list[int] | None) -> dict:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        return choice if ids is None else choice | {"token_ids": ids}


class ChatFormat:
    object, chunk_object, id_prefix = "chat.completion", "chat.completion.chunk", "chatcmpl-"

    def start(self) -> dict | None:
        return {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}

    def delta(self, text: str, finish: str | None, ids: list[int] | None) -> dict:
        choice = {"index": 0, "delta": {"content": text} if text or not finish else {}, "logprobs": None,
                  "finish_reason": finish}
        return choice if ids is None else choice | {"token_ids": ids}

    def final(self, text: str, finish: str | None, ids: list[int] | None) -> dict:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                  "finish_reason": finish}
        return choice if ids is None else choice | {"token_ids": ids}


def sse(payload: dict | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


class EventStream(StreamingResponse):
    """Server-sent events that cancel their request however the response ends."""

    def __init__(self, content, handle):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.handle = handle

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if not self.handle.done:
                self.handle.cancel()
            try:
                await self.body_iterator.aclose()
            except Exception:  # noqa: BLE001 - the client is gone; nothing left to tell it
                pass


async def disconnected(request: Request) -> None:
    """Returns when the client of a request whose body was read goes away."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
