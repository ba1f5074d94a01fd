"""A request of the serving engine, and the handle its submitter holds.

    >>> handle = engine.submit("Hello", max_new_tokens=32)
    >>> handle.result(timeout=60)             # token ids generated (prompt excluded)
    >>> for token in handle.stream(): ...     # as they come
    >>> async for token in handle.astream(): ...
    >>> handle.cancel()

A `Request` is a `Sequence` (its KV in the pool) plus what the engine needs to decide about it:
sampling parameters, tenant, priority, the tokens generated so far and timestamps. The engine
thread is the only one that changes it; the handle only reads its stream and may ask to cancel.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from .. import arguments
from ..cache.sequence import Sequence
from ..errors import PagedKVError

_ids = itertools.count(1)
MAX_LOGPROBS = 20  # alternatives per token, as OpenAI's top_logprobs and vLLM's default bound


@dataclass(frozen=True)
class SamplingParams:
    """How a request's tokens are chosen. Greedy rows take the argmax of the scores after the
    penalties, the bias and `min_tokens`; sampling rows also go through temperature, top-k, top-p
    and min-p (the order of transformers' `generate`).

    - `repetition_penalty`: transformers' (and vLLM's): the scores of every token in the prompt
      or the output so far are divided by it where positive, multiplied where negative; 1 is off.
    - `presence_penalty`, `frequency_penalty`: OpenAI's: each token's score less `presence` if
      it occurs in the output so far and `frequency` times its count there; 0 is off.
    - `logit_bias`: `(token, bias)` pairs added to those tokens' scores (OpenAI's, -100..100 there).
    - `min_tokens`: the end tokens (`eos_token_id`) cannot be chosen before this many are generated.
    - `min_p`: sampling keeps the tokens whose probability is at least `min_p` times the top one's.
    - `logprobs`: with k (0 to `MAX_LOGPROBS`), each generated token comes with its log-probability
      and the k likeliest tokens' (`Request.logprobs`): the model's own log-softmax, before any
      penalty, bias or temperature; None: none.
    """

    max_new_tokens: int = 64
    do_sample: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    eos_token_id: tuple[int, ...] = ()
    seed: int | None = None
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    logprobs: int | None = None

    def __post_init__(self):
        for name in ("max_new_tokens", "top_k", "min_tokens"):
            object.__setattr__(self, name, arguments.integer(name, getattr(self, name)))  # numpy integers too, as int
        if self.seed is not None:
            object.__setattr__(self, "seed", arguments.integer("seed", self.seed))
        if not isinstance(self.do_sample, bool):
            raise ValueError(f"do_sample must be True or False, got {self.do_sample!r}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not math.isfinite(self.temperature) or (self.do_sample and self.temperature <= 0):
            raise ValueError(f"temperature must be finite, and > 0 when sampling, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0: off), got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1] (0: off), got {self.min_p}")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            raise ValueError(f"repetition_penalty must be > 0 (1: off), got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} must be a finite number (0: off), got {getattr(self, name)}")
        bias = dict(self.logit_bias)  # pairs, or a mapping: one bias per token
        object.__setattr__(self, "logit_bias", tuple((arguments.integer("a logit_bias token", token), float(value))
                                                     for token, value in bias.items()))
        if not all(math.isfinite(value) for _, value in self.logit_bias):
            raise ValueError("logit_bias values must be finite numbers")
        if self.logprobs is not None:
            object.__setattr__(self, "logprobs", arguments.integer("logprobs", self.logprobs))
            if not 0 <= self.logprobs <= MAX_LOGPROBS:
                raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}] (or None), got {self.logprobs}")
        if not 0 <= self.min_tokens <= self.max_new_tokens:
            raise ValueError(f"min_tokens must be in [0, max_new_tokens={self.max_new_tokens}], got {self.min_tokens}")


class TokenStream:
    """Tokens as the engine produces them, readable from any thread or event loop."""

    def __init__(self):
        self.tokens: list[int] = []
        self.error: BaseException | None = None
        self.done = False
        self.changed = threading.Condition()
        self.waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = []

    def push(self, token: int) -> None:
        with self.changed:
            self.tokens.append(token)
            self._wake()

    def close(self, error: BaseException | None = None) -> None:
        with self.changed:
            self.error, self.done = error, True
            self._wake()

    def _wake(self) -> None:
        self.changed.notify_all()
        for loop, future in self.waiters:
            try:
                loop.call_soon_threadsafe(lambda f=future: f.done() or f.set_result(None))
            except RuntimeError:  # that reader's event loop has closed: nobody waits there any more
                pass
        self.waiters.clear()

    def wait_done(self, timeout: float | None) -> bool:
        with self.changed:
            return self.changed.wait_for(lambda: self.done, timeout)

    def __iter__(self):
        seen = 0
        while True:
            with self.changed:
                self.changed.wait_for(lambda: len(self.tokens) > seen or self.done)
                fresh, finished, error = self.tokens[seen:], self.done, self.error
            seen += len(fresh)
            yield from fresh
            if finished and seen == len(self.tokens):
                if error is not None:
                    raise error
                return

    async def __aiter__(self):
        seen, loop = 0, asyncio.get_running_loop()
        while True:
            with self.changed:
                fresh, finished, error = self.tokens[seen:], self.done, self.error
                future = None
                if not fresh and not finished:
                    future = loop.create_future()
                    self.waiters.append((loop, future))
            if future is not None:
                try:
                    await future
                finally:  # a reader cancelled here leaves no waiter behind for a loop that may close
                    with self.changed:
                        if (loop, future) in self.waiters:
                            self.waiters.remove((loop, future))
                continue
            seen += len(fresh)
            for token in fresh:
                yield token
            if finished and seen == len(self.tokens):
                if error is not None:
                    raise error
                return


@dataclass(eq=False)
class Request:
    prompt: list[int]
    params: SamplingParams
    tenant: str = "default"
    priority: int = 0
    id: int = field(default_factory=lambda: next(_ids))
    sequence: Sequence = field(default_factory=Sequence)
    generated: list[int] = field(default_factory=list)
    stream: TokenStream = field(default_factory=TokenStream)
    generator: torch.Generator | None = None
    arrived: float = field(default_factory=time.monotonic)
    admitted: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    finished: float | None = None
    outcome: str | None = None  # "finished", "cancelled", "failed", "rejected"
    cancel_requested: str | None = None  # the outcome asked for: "cancelled", or "finished" early
    preemptions: int = 0
    # per generated token, with `params.logprobs`: (its log-probability, [(token, log-probability)
    # of the likeliest `params.logprobs`]), set before the token reaches the stream
    logprobs: list[tuple[float, list[tuple[int, float]]]] = field(default_factory=list)
    inherited: int = 0  # tokens whose KV the last admission found cached (after a preemption: generated ones too)
    computed: int = 0  # leading tokens of `tokens()` stored in the sequence
    reached: int = 0  # the most ever stored: after a preemption, tokens up to here are computed again
    constraint: Any = None  # structured output: the grammar's matcher (engine.grammar.Constraint)
    swapped: tuple | None = None  # while preempted: (weights' fingerprint, tokens, its partial block's K/V on the host)

    def __post_init__(self):
        # checked in the submitter's thread: a bad value found by the engine's thread would fail
        # every request of the step that met it
        self.tenant, self.priority = arguments.tenant(self.tenant), arguments.priority(self.priority)

    def ask_to_stop(self, outcome: str) -> None:
        """A caller's wish to stop it: "cancelled", or "finished" when it has what it wants. The
        first wish stands: a stream closed after its stop string matched (finished) is cancelled
        again, and that must not count the request as cancelled."""
        if outcome not in ("cancelled", "finished"):
            raise ValueError(f"outcome must be 'cancelled' or 'finished', got {outcome!r}")
        self.cancel_requested = self.cancel_requested or outcome

    def generator_on(self, device: torch.device) -> torch.Generator | None:
        """A seeded request's generator, made at first use on the device its scores are on (with a
        device map, not known before the first forward returns them)."""
        if self.generator is None and self.params.seed is not None:
            self.generator = torch.Generator(device).manual_seed(self.params.seed)
        return self.generator

    def tokens(self) -> list[int]:
        """The prompt and every generated token: what the sequence must hold before the next
        token is sampled. The engine feeds `tokens()[computed:]` in chunks; the forward that
        reaches the end samples the next token (one token per step once the prompt is in)."""
        return self.prompt + self.generated

    def kv_needed(self) -> int:
        """Tokens of KV the sequence holds at most before its next sample: `tokens()`, and the
        next token's unless that is its last (the token reaching max_new_tokens is never fed)."""
        return len(self.tokens()) + (len(self.generated) + 1 < self.params.max_new_tokens)

    def blocks_needed(self, block_size: int) -> int:
        """Blocks of `block_size` that `kv_needed` tokens fill."""
        return -(-self.kv_needed() // block_size)

    @property
    def remaining(self) -> int:
        """Tokens still to feed before the next token can be sampled."""
        return len(self.prompt) + len(self.generated) - self.computed

    def ends_prompt(self, count: int) -> bool:
        """Whether feeding `count` more tokens ends the prompt: the forward samples the first token."""
        return not self.generated and count == self.remaining

    @property
    def effective_priority(self) -> int:
        """A request preempted again and again gains priority (no starvation)."""
        return self.priority + self.preemptions


class RequestHandle:
    """What `Engine.submit` returns: the request's tokens as they come, and a way to cancel it."""

    def __init__(self, request: Request, engine):
        self.request, self.engine = request, engine

    @property
    def id(self) -> int:
        return self.request.id

    def result(self, timeout: float | None = None) -> list[int]:
        """The generated token ids (prompt excluded), once the request is done. Raises the error
        it ended with (`RequestFailed`: its `tokens` are those generated before it failed)."""
        stream = self.request.stream
        if not stream.wait_done(timeout):
            raise TimeoutError(f"request {self.id} not done after {timeout} s")
        if stream.error is not None:
            if isinstance(stream.error, RequestFailed):
                stream.error.tokens = list(stream.tokens)
            raise stream.error
        return list(stream.tokens)

    def stream(self):
        """Iterate over the generated token ids as the engine produces them."""
        return iter(self.request.stream)

    def astream(self):
        """`async for token in handle.astream()`."""
        return self.request.stream.__aiter__()

    def cancel(self) -> None:
        """Stop generating; the tokens so far stay readable and `result()` returns them."""
        self.engine.cancel(self)

    def finish(self) -> None:
        """Stop generating because the caller has what it wants (a stop string matched): like
        `cancel`, but the request counts as finished."""
        self.engine.cancel(self, outcome="finished")

    @property
    def done(self) -> bool:
        return self.request.stream.done

    @property
    def timings(self) -> dict:
        """Monotonic times (seconds) of the request's life, and what happened to it: `inherited`
        counts the tokens whose KV its last admission found cached (after a preemption, the
        request's own blocks, generated tokens included)."""
        r = self.request
        return {"arrived": r.arrived, "admitted": r.admitted, "first_token": r.first_token, "last_token": r.last_token,
                "finished": r.finished, "preemptions": r.preemptions, "inherited": r.inherited,
                "generated": len(r.generated)}

    @property
    def outcome(self) -> str | None:
        return self.request.outcome


class RequestFailed(PagedKVError):
    """The engine could not complete the request (the message says why). `tokens`: what it
    generated before it failed, as `RequestHandle.result` raises it (streamed ones stay streamed)."""

    def __init__(self, message: str, tokens: list[int] | None = None):
        super().__init__(message)
        self.tokens = list(tokens or [])
