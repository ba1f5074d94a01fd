"""The serving engine: many independent requests batched into each forward, on the pool.

    >>> from hf_paged_kv import Engine, KVPool
    >>> engine = Engine(model, tokenizer=tokenizer, pool=KVPool(num_blocks=512))
    >>> with engine:                                   # start() / stop(drain=True)
    ...     handle = engine.submit("Hello", max_new_tokens=32)
    ...     print(tokenizer.decode(handle.result()))
    >>> engine.stats()["max_running"], engine.prometheus()

One thread runs the loop. Each step: take in new and cancelled requests, let the scheduler plan
the step (`Scheduler.schedule`: which sequences run, how many tokens each feeds, who was
preempted or admitted), run one packed forward (`runner`), sample each row with its own
parameters, stream the tokens, and end the requests that are done. Requests join and leave
between forwards.
The pool, its reuse index, pins and tiers are the ones `generate` uses, so the engine and
`generate` share cached prefixes.
"""

from __future__ import annotations

import logging
import operator
import queue
import threading
import time
from dataclasses import replace

import numpy as np
import torch

from .. import arguments
from ..errors import PagedKVError, UnsupportedModelError
from ..integration.hooks import current_fingerprint, disable, enable, is_enabled, pool_of, state_of
from ..pool import Advice, KVPool, advise_block_size
from . import openmp, runner
from .config import EngineConfig, Limits
from .controller import Thresholds
from .grammar import Constraint, Grammars
from .load import LoadControl
from .metrics import EngineMetrics
from .outcomes import Outcomes
from .request import Request, RequestFailed, RequestHandle, SamplingParams
from .sampling import sample
from .scheduler import Schedule, Scheduler

log = logging.getLogger("hf_paged_kv.engine")
IDLE_WAIT = 0.05  # seconds the loop sleeps when there is nothing to do


class Engine:
    """Continuous batching on a model's KV pool. See the module docstring for usage.

    Args:
        model: a transformers causal LM (enabled with `hf_paged_kv.enable` if it is not yet; an
            engine that enables it disables it again when it stops).
        tokenizer: needed to submit text prompts.
        pool: the KVPool to enable the model with (if it is not enabled yet).
        config: what a user tunes (`EngineConfig`: running sequences, batch tokens, queue,
            request length, SLO targets, backend).
        **settings: `EngineConfig` fields given one by one instead (`max_num_seqs=32`); the
            older names `max_running` and `max_batch_tokens` still work.
        limits: the scheduler's knobs at once (`Limits`), for experiments: copied, and its
            `max_running`, `max_batch_tokens` and `max_waiting` win over the config's.
        controller: with SLO targets, False only reports goodput against them and adapts
            nothing; None (the default) means "on exactly when targets are given".
        thresholds: when the controller changes state, and how often it decides (`controller.Thresholds`).
    """

    def __init__(self, model, tokenizer=None, pool: KVPool | None = None, config: EngineConfig | None = None, *,
                 limits: Limits | None = None, controller: bool | None = None, thresholds: Thresholds | None = None,
                 **settings):
        config = _configured(config, settings, limits)
        if controller and config.slo is None:
            raise ValueError("load control adapts the engine to service-level targets: give them, "
                             "Engine(slo=SLO(ttft=..., per_token=...)); without targets nothing is shed or paced")
        self.model, self.tokenizer, self.config = model, tokenizer, config
        if model.training:  # dropout would make its KV, shared with later requests, random (and the check below)
            raise PagedKVError("the model is in train mode: call model.eval() before serving it")
        # an engine that enables the model disables it when it stops: the model is left as it came,
        # and a later engine may enable it with another pool
        self.enables_model = not is_enabled(model)
        self.pool = enable(model, pool=pool, backend=config.backend)
        self.backend = state_of(model).backend
        try:
            runner.check_packing(model, self.backend, self.pool)
        except UnsupportedModelError:
            if self.enables_model:  # a refused model is left as it came
                disable(model)
            raise
        self.limits = replace(limits) if limits else Limits(max_running=config.max_num_seqs,
                                                            max_batch_tokens=config.max_num_batched_tokens,
                                                            max_waiting=config.max_waiting)
        self.scheduler = Scheduler(self.pool, self.limits)
        self.metrics = EngineMetrics(config.served_model_name or getattr(model, "name_or_path", "") or "model")
        self.load = LoadControl(self.limits, self.scheduler, self.pool, self.metrics,
                                config.slo is not None if controller is None else controller, config.slo, thresholds)
        self.outcomes = Outcomes(self.scheduler, self.metrics, self.load)
        self.cancelled: queue.SimpleQueue = queue.SimpleQueue()
        self.wakeup = threading.Event()
        self.gate = threading.Lock()  # a submit either queues before stop() stops accepting, or is refused
        self.thread: threading.Thread | None = None
        self.accepting, self.draining = False, True
        self.eos = tuple(_as_list(model.generation_config.eos_token_id))
        self.max_model_len, self.length_limit = _max_model_len(model, config.max_model_len)
        self.grammars = Grammars(tokenizer, model.get_input_embeddings().num_embeddings)

    # ------------------------------------------------------------ lifecycle
    def start(self) -> "Engine":
        if self.thread is not None and not self.thread.is_alive():  # a stop() that timed out, since done
            self.thread = None
        if self.thread is not None and not self.accepting:
            raise PagedKVError("the engine's previous loop is still stopping: call stop() again and let it finish")
        if self.thread is None:
            if self.enables_model and not is_enabled(self.model):  # stopped before: enabled again, same pool
                enable(self.model, pool=self.pool, backend=self.config.backend)
                self.backend = state_of(self.model).backend
            self.accepting = True
            self.load.start()
            openmp.release_workers()  # this thread's idle OpenMP workers would throttle the engine's
            self.thread = threading.Thread(target=self._loop, name="hf_paged_kv-engine", daemon=True)
            self.thread.start()
        return self

    def stop(self, drain: bool = True, timeout: float | None = None) -> None:
        """Stop accepting requests; finish the ones in flight (`drain`) or cancel them."""
        with self.gate:
            self.accepting, self.draining = False, drain
        self.wakeup.set()
        if self.thread is not None:
            self.thread.join(timeout)
            if not self.thread.is_alive():  # else it is still draining: start() must not add a second loop
                self.thread = None
        if self.thread is None:  # no loop (never started, or it died): what is queued ends here
            self._intake()
            self.outcomes.end_all("cancelled")
            if self.enables_model and is_enabled(self.model) and pool_of(self.model) is self.pool:
                disable(self.model)

    def __enter__(self) -> "Engine":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop(drain=exc[0] is None)

    # ------------------------------------------------------------- requests
    def submit(self, prompt, max_new_tokens: int = 64, do_sample: bool = False, temperature: float = 1.0,
               top_p: float = 1.0, top_k: int = 0, eos_token_id=None, tenant: str = "default", priority: int = 0,
               seed: int | None = None, *, min_p: float = 0.0, repetition_penalty: float = 1.0,
               presence_penalty: float = 0.0, frequency_penalty: float = 0.0, logit_bias=None,
               min_tokens: int = 0, logprobs: int | None = None, json_schema: dict | str | bool | None = None,
               strict: bool = True) -> RequestHandle:
        """Queue a request (text or token ids) and return its handle at once. Thread-safe.
        Raises `Overloaded` (with `retry_after`) when the engine sheds load. The sampling
        arguments are `SamplingParams`' (`logit_bias`: a mapping of token id to bias). `json_schema`
        holds the output to a JSON schema (a dict or JSON text; True: any JSON value; `strict`:
        no properties beyond the schema's), see `grammar`; a schema that cannot be compiled is a
        `GrammarError` (a ValueError).

            engine.submit("Hello", max_new_tokens=32, repetition_penalty=1.2, logit_bias={13: -100})
        """
        if not self.accepting:
            raise PagedKVError("the engine is not running: call start() or use it as a context manager")
        if self.model.training:  # dropout would make its KV, shared with later requests, random
            raise PagedKVError("the model is in train mode: call model.eval() before serving it")
        vocabulary = self.model.get_input_embeddings().num_embeddings
        ids = _prompt_ids(prompt, self.tokenizer, vocabulary)
        eos = self.eos if eos_token_id is None else tuple(_as_list(eos_token_id, vocabulary))
        params = SamplingParams(max_new_tokens, do_sample, temperature, top_p, top_k, eos, seed, min_p,
                                repetition_penalty, presence_penalty, frequency_penalty, logit_bias or (), min_tokens,
                                logprobs)
        outside = [token for token, _ in params.logit_bias if not 0 <= token < vocabulary]
        if outside:
            raise ValueError(f"logit_bias names tokens outside the model's vocabulary of {vocabulary}: {outside[:5]}")
        limit = self.max_model_len
        if limit is not None and len(ids) + params.max_new_tokens > limit:  # the last token is never fed
            raise ValueError(f"{len(ids)} prompt tokens + max_new_tokens={params.max_new_tokens} pass max_model_len="
                             f"{limit}: {self.length_limit}")
        constraint = None
        if json_schema is not None and json_schema is not False:
            constraint = Constraint(self.grammars.compile(json_schema, strict), params.eos_token_id, vocabulary)
        request = Request(ids, params, tenant=tenant, priority=priority, constraint=constraint)
        with self.gate:  # refused or queued at once: the queue cannot pass max_waiting, nor stop() lose it
            if not self.accepting:
                raise PagedKVError("the engine stopped while the request was being submitted")
            self.load.admit_or_refuse(priority)
            self.scheduler.submit(request)
        self.wakeup.set()
        return RequestHandle(request, self)

    def cancel(self, handle: RequestHandle, outcome: str = "cancelled") -> None:
        """Stop `handle`'s request as "cancelled" or "finished" (`handle.cancel()`, `.finish()`)."""
        if handle.engine is not self:
            raise ValueError("this handle belongs to another engine: cancel it there (handle.cancel())")
        handle.request.ask_to_stop(outcome)
        self.cancelled.put(handle.request)
        self.wakeup.set()

    # ----------------------------------------------------------------- loop
    def _loop(self) -> None:
        outcome, reason = "cancelled", None  # what becomes of the requests still here when the loop ends
        try:
            self._serve()
        except BaseException as error:  # the loop dies (SystemExit, an interrupt sent to its thread): none may wait on it
            with self.gate:
                self.accepting = False
            log.exception("the engine's loop ended: every request queued, waiting or running fails")
            outcome, reason = "failed", f"the engine's loop ended ({type(error).__name__}; see the server log)"
            raise
        finally:
            try:
                self._intake()  # requests queued just before stop() stopped accepting
            finally:
                self.outcomes.end_all(outcome, reason)
                self.load.stop()

    def _serve(self) -> None:
        idle = True
        # stop is checked first: a fault that repeats in intake or tick must not keep stop() waiting
        while self.accepting or (self.draining and self.scheduler.busy()):
            try:
                self._intake()
                for request in self.load.tick_guarded():
                    self.outcomes.turn_away(request)
                if self.step():
                    idle = False
                    continue
            except Exception as error:  # noqa: BLE001 - a step that fails must not leave requests waiting forever
                log.exception("the engine's step failed: every request running or waiting fails, the engine goes on")
                # the error's text may hold another request's data: its kind only, the log has the rest
                self.outcomes.end_all("failed", f"the engine's step failed ({type(error).__name__}; see the server log)")
            if not idle:  # going idle: free the cores' OpenMP workers for other threads (see openmp)
                openmp.release_workers()
                idle = True
            self.wakeup.wait(IDLE_WAIT)
            self.wakeup.clear()

    def _intake(self) -> None:
        with self.gate:  # a request moving between the queues is in neither: submit's backlog would miss it
            self.scheduler.intake()
        while not self.cancelled.empty():
            request = self.cancelled.get()
            if request.outcome is None:
                self.outcomes.end(request, request.cancel_requested)

    def step(self) -> bool:
        """One scheduler step; False when there was nothing to run."""
        if not (self.scheduler.waiting or self.scheduler.running):
            return False
        started = time.perf_counter()
        model = current_fingerprint(self.model, max_age=1.0, look=True) if self.scheduler.waiting else None
        plan = self.scheduler.schedule(model)
        self._account(plan)
        if not plan.batch:
            return False
        whole = self._forward(plan.batch)
        seconds = time.perf_counter() - started
        self.scheduler.stepped(sum(n for _, n in plan.batch), seconds, whole)
        self.metrics.stepped(seconds)
        return True

    def _account(self, plan: Schedule) -> None:
        """Count what the plan did besides its batch, and end the requests no pool could hold."""
        for _, mode in plan.preempted:
            self.load.signals.record("preemption")
            self.metrics.preempted(mode)
        for request in plan.admitted:
            self.metrics.admitted(request)
            self.load.signals.record("queue_wait", request.admitted - request.arrived)
        self.metrics.inherited(plan.inherited)
        for request, reason in plan.impossible:
            self.outcomes.cannot_fit(request, reason)

    def _forward(self, batch: list[tuple[Request, int]]) -> bool:
        """Run, commit and sample `batch`; False when it failed (and its rows ran one by one)."""
        try:
            logits, sampling = runner.forward(self.model, self.backend, self.pool, batch)
        except Exception as error:  # noqa: BLE001 - a failed forward fails its requests, never the engine
            if len(batch) > 1:  # find the culprit: each alone (their KV slots are written again)
                for row in batch:
                    self._forward([row])
            else:
                self.outcomes.end(batch[0][0], "failed", RequestFailed(f"forward failed: {error!r}"))
            return False
        self.metrics.forward(batch, *runner.token_kinds(batch), len(self.scheduler.running))
        runner.commit(batch)
        self.scheduler.committed(batch)
        now = time.monotonic()
        for request, token in zip(sampling, sample(logits, sampling)):
            if isinstance(token, Exception):
                self.outcomes.end(request, "failed", RequestFailed(f"sampling failed: {token!r}"))
            else:
                self.outcomes.emit(request, token, now)
        return True

    # ---------------------------------------------------------------- stats
    def stats(self) -> dict:
        """Request and token counters, the high-water mark of running sequences, and the pool's stats."""
        return self.pool.stats() | dict(self.metrics.counters) | self.load.stats() | {
            "requests_running": len(self.scheduler.running),
            "requests_waiting": self.scheduler.backlog(),
            "growth_ratio": self.scheduler.growth.ratio,
        }

    def advise_block_size(self, shared_prefix_lengths=()) -> Advice:
        """The block size the observed sequence lengths suggest for the next start (see
        `hf_paged_kv.pool.advisor`); a live pool keeps its own."""
        return advise_block_size(self.scheduler.lengths or [1], shared_prefix_lengths)

    def prometheus(self) -> str:
        """The metrics in Prometheus' text exposition format."""
        self.metrics.observe(self.stats())
        return self.metrics.text()


LEGACY_NAMES = {"max_running": "max_num_seqs", "max_batch_tokens": "max_num_batched_tokens"}


def _configured(config: EngineConfig | None, settings: dict, limits: Limits | None) -> EngineConfig:
    """`config` with the `settings` given one by one (older names mapped to the config's), and a
    `limits`' queue and batch sizes, which win."""
    fields = {LEGACY_NAMES.get(name, name): value for name, value in settings.items()}
    unknown = sorted(set(fields) - set(EngineConfig.__dataclass_fields__))
    if unknown:
        raise TypeError(f"Engine() got unknown settings {unknown}; EngineConfig has "
                        f"{sorted(EngineConfig.__dataclass_fields__)}")
    if limits is not None:
        fields |= dict(max_num_seqs=limits.max_running, max_num_batched_tokens=limits.max_batch_tokens,
                       max_waiting=limits.max_waiting)
    return replace(config or EngineConfig(), **fields)


def _max_model_len(model, asked: int | None) -> tuple[int | None, str]:
    """The most tokens one request may hold (None: no limit) and why: the configured
    `max_model_len`, or the length where the model's RoPE starts to scale (one packed forward of
    many requests cannot give each its own scaling). The model's context is not enforced: as with
    `generate`, a request may pass it where its position encoding allows."""
    limits = [(asked, "the engine's configured limit"),  # on a tie, the first says why
              (state_of(model).rope_limit, "where this model's RoPE starts to scale with the forward's length: one "
               "packed forward of many requests cannot give each its own; generate with a PagedCache runs longer "
               "ones exactly")]
    limits = [(n, why) for n, why in limits if n is not None]
    return min(limits, key=lambda item: item[0]) if limits else (None, "")


def _prompt_ids(prompt, tokenizer, vocabulary: int) -> list[int]:
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("a text prompt needs Engine(tokenizer=...)")
        prompt = tokenizer(prompt)["input_ids"]
    ids = prompt.tolist() if torch.is_tensor(prompt) or isinstance(prompt, np.ndarray) else list(prompt)
    if ids and isinstance(ids[0], list):  # [1, n], as a tokenizer returns it
        if len(ids) != 1:
            raise ValueError(f"the prompt must be one sequence of token ids, got a batch of {len(ids)}: submit each")
        ids = ids[0]
    try:
        ids = [operator.index(t) for t in ids]
    except TypeError:
        raise ValueError("the prompt must be text or a sequence of integer token ids") from None
    if not ids:
        raise ValueError("the prompt is empty")
    outside = [t for t in ids if not 0 <= t < vocabulary]
    if outside:  # it would fail the forward it joins (on CUDA, a device-side assert)
        raise ValueError(f"token ids outside the model's vocabulary of {vocabulary}: {outside[:5]}")
    return ids


def _as_list(value, vocabulary: int | None = None) -> list[int]:
    """Stop token ids as a list (None: none); those given to `submit` are checked against the
    `vocabulary` (an id outside it could never stop the request)."""
    if value is None:
        return []
    ids = [arguments.integer("eos_token_id", v) for v in (value if isinstance(value, (list, tuple)) else [value])]
    outside = [t for t in ids if vocabulary is not None and not 0 <= t < vocabulary]
    if outside:
        raise ValueError(f"eos_token_id outside the model's vocabulary of {vocabulary}: {outside[:5]}")
    return ids
