"""Serving many requests at once on SmolLM2-135M (fp32; CPU, or CUDA when there is one): the engine
against what a user of transformers has today, at the same KV memory.

    python bench/bench_engine.py                          # full run: 64 requests, rates 1, 2, all at once
    python bench/bench_engine.py --rates 0.5,1,2,4,inf --repeats 3
    python bench/bench_engine.py --smoke                  # tiny random Llama, a few seconds, prints only

Workload: 64 requests cut from real English text (`common.real_text`, fixed seeds): prompts of
mixed lengths (log-uniform), a third of them one shared system prompt followed by a question of
their own. Each request has its own `max_new_tokens` and stops at the end of its first sentence
(the "." token; the model's EOS too), as a client asking for one sentence would: output lengths
vary and most requests stop well before `max_new_tokens`. Arrivals are Poisson at each rate of
`--rates` (requests/s, seeded; `inf` = all at once); every system serves the same trace in real
time.

KV memory: a pool of `--pool-fraction` of the blocks the 64 requests would reserve statically
(prompt + max_new_tokens each): not all of them fit at once. Every system gets the same KV bytes:

- sequential `generate` (DynamicCache, one request at a time, FIFO): one request's KV at a time,
  always under the budget; its outputs are the reference (per-request greedy `generate`);
- padded micro-batches of `generate` (DynamicCache, left-padded): whenever the server is free it
  takes up to k waiting requests; k is the largest batch whose padded DynamicCache (longest prompt
  + largest max_new_tokens of the workload, every row) fits in the budget, at most 8;
- transformers' `ContinuousBatchingManager` (`init_continuous_batching`, streaming): its
  `ContinuousBatchingConfig` gets the pool's `num_blocks` and `block_size` (its KV tensors have the
  same layout: the same bytes, plus its two padding blocks), the same `max_batch_tokens` and
  `max_requests_per_batch` = the engine's `max_running`; it runs on a copy of the model that was
  never enabled (it switches that copy to `paged|sdpa` itself and back when stopped);
- `hf_paged_kv.Engine` on a fresh `KVPool` of that size per run, `controller=False` (fixed knobs:
  the load controller is `bench_load.py`'s subject).

Reported per rate: throughput (generated tokens / makespan, from the first arrival to the last
token), p50/p95 time to first token (from the scheduled arrival) and per-token latency (per
request: (last - first token) / (tokens - 1)), max and mean concurrent sequences (sampled every
50 ms; the engine's max is its exact high-water mark), preemptions, peak KV bytes, failed
requests, and whether every request's tokens equal per-request greedy `generate`. Also the
compute floor (the model alone on the unique prompt tokens and the output tokens in the fewest
forwards of at most `max_batch_tokens` that any schedule can use, or on the engine's own forwards
replayed where that was cheaper, measured in the same run) with the engine's time relative to it, split into the cost of its schedule (the model alone replaying
the engine's forwards) and the engine's own cost, and the engine's concurrency against a static
reservation of prompt + max_new_tokens per request.

The engine's tokens must equal per-request `generate` and none of its requests may fail, or the
script exits 1 and writes nothing; the other systems' mismatches are reported, not hidden.
"""

from __future__ import annotations

import heapq
import importlib.util
import math
import re
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import common
import numpy as np
import torch
from common import (
    Checks,
    arguments,
    check_repeats,
    dynamic_cache_bytes,
    left_pad,
    load_model,
    markdown_table,
    model_name,
    note,
    prompts_of_lengths,
)
from transformers import ContinuousBatchingConfig, DynamicCache, GenerationConfig
from transformers.generation.streamers import BaseStreamer

import hf_paged_kv
from hf_paged_kv import Engine, KVPool, Overloaded
from hf_paged_kv.engine import SLO, Limits, Thresholds, openmp

ROOT = Path(__file__).resolve().parent.parent

FULL = dict(requests=64, system_tokens=160, prompt=(24, 320), question=(16, 64), new=(16, 64), block_size=16,
            pool_fraction=0.3, batch_tokens=256, max_running=64, max_micro=8, rates="1,2,inf", warmup=6)
SMOKE = dict(requests=12, system_tokens=24, prompt=(6, 40), question=(4, 10), new=(4, 12), block_size=8,
             pool_fraction=0.35, batch_tokens=64, max_running=16, max_micro=4, rates="40,inf", warmup=3)


# ----------------------------------------------------------------------------------- model

def load(smoke: bool, device: str | torch.device = "cpu"):
    """`(model, tokenizer)` on `device`: a new model object per call, same weights."""
    model, tokenizer = load_model(True) if smoke else (smollm2_loader()(dtype=torch.float32))
    return model.to(device), tokenizer


def load_pair(smoke: bool, device: str | torch.device = "cpu"):
    """`(plain, model, tokenizer, pad_id, stop)`: the model twice (a never-enabled copy for the
    systems other than the engine, and the engine's), the tokenizer, the pad id and the stop ids."""
    plain, tokenizer = load(smoke, device)
    model, _ = load(smoke, device)
    return plain, model, tokenizer, pad_token(model, tokenizer), stop_ids(model, tokenizer)


def pad_token(model, tokenizer) -> int:
    """The generation config's pad id, else the tokenizer's."""
    pad_id = model.generation_config.pad_token_id
    return tokenizer.pad_token_id if pad_id is None else pad_id


def smollm2_loader():
    """`load_smollm2` from wherever the project keeps it: `hf_paged_kv.real_model`, or
    `examples/real_model.py` or `examples/smollm2.py`; else common's own search (which says
    clearly what it did not find)."""
    try:
        from hf_paged_kv.real_model import load_smollm2

        return load_smollm2
    except ImportError:
        pass
    for name in ("real_model.py", "smollm2.py"):
        path = ROOT / "examples" / name
        if path.is_file():
            spec = importlib.util.spec_from_file_location(f"hf_paged_kv_examples_{path.stem}", path)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            return module.load_smollm2
    return common.smollm2_loader()


def pick_device(name: str | None) -> torch.device:
    return torch.device(name or ("cuda" if torch.cuda.is_available() else "cpu"))


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def stop_ids(model, tokenizer) -> list[int]:
    """The end of a sentence ('.') and the model's EOS token(s)."""
    period = tokenizer(".", add_special_tokens=False)["input_ids"][-1]
    eos = model.generation_config.eos_token_id
    eos = [] if eos is None else (list(eos) if isinstance(eos, (list, tuple)) else [eos])
    return sorted({int(period), *map(int, eos)})


# -------------------------------------------------------------------------------- workload

@dataclass
class Req:
    index: int
    prompt: list[int]
    max_new: int
    arrival: float = 0.0  # seconds after the trace starts
    priority: int = 0
    shared: int = 0  # leading tokens shared with other requests (a system prompt or a conversation)
    group: str = ""  # which prefix it shares


def log_uniform(rng, low: int, high: int, n: int) -> list[int]:
    return [int(round(x)) for x in np.exp(rng.uniform(math.log(low), math.log(high), n))]


def workload(tokenizer, size: dict, seed: int = 0) -> list[Req]:
    """`requests` prompts of mixed lengths from real text, a third = one system prompt + a question."""
    rng = np.random.default_rng(seed)
    n = size["requests"]
    shared = set(rng.permutation(n)[: n // 3].tolist())
    system = prompts_of_lengths(tokenizer, [size["system_tokens"]], seed=seed + 100)[0]
    questions = prompts_of_lengths(tokenizer, log_uniform(rng, *size["question"], n), seed=seed + 101)
    plain = prompts_of_lengths(tokenizer, log_uniform(rng, *size["prompt"], n), seed=seed + 102)
    news = rng.integers(size["new"][0], size["new"][1] + 1, n)
    reqs = []
    for i in range(n):
        if i in shared:
            reqs.append(Req(i, system + questions[i], int(news[i]), shared=len(system), group="system"))
        else:
            reqs.append(Req(i, plain[i], int(news[i])))
    return reqs


def poisson(reqs: list[Req], rate: float, seed: int) -> list[Req]:
    """The same requests with Poisson arrivals at `rate` per second (inf: all at once), seeded."""
    if math.isinf(rate):
        times = np.zeros(len(reqs))
    else:
        gaps = np.random.default_rng(seed).exponential(1 / rate, len(reqs))
        times = np.cumsum(gaps) - gaps[0]
    return [Req(r.index, r.prompt, r.max_new, float(t), r.priority, r.shared, r.group) for r, t in zip(reqs, times)]


def unique_prompt_tokens(reqs: list[Req]) -> int:
    """Prompt tokens once each shared prefix is counted once."""
    seen, total = set(), 0
    for r in reqs:
        total += len(r.prompt) - (r.shared if r.group in seen else 0)
        if r.group:
            seen.add(r.group)
    return total


def blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


def most_that_fit(needs: list[int], budget: int) -> int:
    """How many of `needs` (blocks each) fit in `budget` blocks at once, smallest first."""
    return int(np.searchsorted(np.cumsum(sorted(needs)), budget, side="right"))


def concurrency_ceiling(reqs: list[Req], num_blocks: int, block_size: int) -> int:
    """The most requests whose KV fits in `num_blocks` at once, each holding at least its prompt
    and its first generated token, the shared prefix's full blocks stored once: an upper bound
    on running sequences for any system."""
    best = 0
    for share in (False, True):
        prefix = max((r.shared // block_size for r in reqs if r.group), default=0) if share else 0
        needs = [blocks_for(len(r.prompt) + 1, block_size) - (r.shared // block_size if share and r.group else 0)
                 for r in reqs]
        best = max(best, most_that_fit(needs, num_blocks - prefix))
    return best


def bytes_per_block(model, num_blocks: int, block_size: int) -> int:
    """The KV bytes of one block of `model` (enabled on a pool of that size, then disabled)."""
    hf_paged_kv.enable(model, pool=KVPool(num_blocks=num_blocks, block_size=block_size))
    per_block = hf_paged_kv.pool_of(model).bytes_per_block
    hf_paged_kv.disable(model)
    return per_block


def cut(tokens: list[int], stop: list[int], limit: int) -> list[int]:
    """What a request gets: up to its own max_new_tokens, up to and including the first stop token."""
    tokens = tokens[:limit]
    for i, t in enumerate(tokens):
        if t in stop:
            return tokens[: i + 1]
    return tokens


# ---------------------------------------------------------------------------- measurement

@dataclass
class Outcome:
    arrival: float  # absolute (time.monotonic) scheduled arrival
    tokens: list[int] | None = None
    first: float | None = None  # absolute time of the first token
    last: float | None = None
    error: str | None = None
    refused: bool = False  # refused with retry_after and not retried any more
    attempts: int = 1
    priority: int = 0


@dataclass
class Run:
    system: str
    t0: float
    outcomes: list[Outcome]
    samples: list[tuple] = field(default_factory=list)  # (t, running, waiting, kv_bytes, extra dict)
    preemptions: int | None = None
    peak_kv: int = 0
    max_running: int | None = None
    busy: float | None = None  # seconds the engine spent in steps
    retries: int = 0
    refusals: int = 0
    extra: dict = field(default_factory=dict)


class Monitor:
    """Samples `probe() -> (running, waiting, kv_bytes, extra)` every `period` seconds on a thread."""

    def __init__(self, probe, period: float):
        self.probe, self.period, self.samples = probe, period, []
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stopped.set()
        self.thread.join()

    def _run(self):
        while not self.stopped.is_set():
            try:
                self.samples.append((time.monotonic(), *self.probe()))
            except Exception:  # noqa: BLE001 - a structure changing under the sampler: skip this sample
                pass
            self.stopped.wait(self.period)


def pct(values, q) -> float:
    return float(np.percentile(values, q)) if len(values) else float("nan")


def per_token(o: Outcome) -> float | None:
    return (o.last - o.first) / (len(o.tokens) - 1) if o.tokens and len(o.tokens) > 1 else None


def completed(o: Outcome) -> bool:
    return o.tokens is not None and o.error is None and o.first is not None


def summarize(run: Run, reference: list[list[int]] | None) -> dict:
    done = [o for o in run.outcomes if completed(o)]
    end = max((o.last for o in done), default=run.t0)
    makespan = max(end - run.t0, 1e-9)
    generated = sum(len(o.tokens) for o in done)
    window = [s for s in run.samples if run.t0 <= s[0] <= end]
    running = [s[1] for s in window]
    mismatched = [] if reference is None else [
        i for i, o in enumerate(run.outcomes) if completed(o) and o.tokens != reference[i]]
    return dict(
        makespan=makespan, generated=generated, throughput=generated / makespan,
        ttft_p50=pct([o.first - o.arrival for o in done], 50), ttft_p95=pct([o.first - o.arrival for o in done], 95),
        tok_p50=pct([x for o in done if (x := per_token(o)) is not None], 50),
        tok_p95=pct([x for o in done if (x := per_token(o)) is not None], 95),
        max_running=run.max_running if run.max_running is not None else max(running, default=0),
        mean_running=float(np.mean(running)) if running else 0.0,
        preemptions=run.preemptions, peak_kv=run.peak_kv, busy=run.busy,
        forwards=len(run.extra["forwards"]) if "forwards" in run.extra else None,
        model_alone=run.extra.get("model_alone"),
        failed=len(run.outcomes) - len(done), mismatched=mismatched,
    )


# -------------------------------------------------------------------- generate (DynamicCache)

class StepClock(BaseStreamer):
    """Records when each decoding step's tokens come out of `generate` (the first put is the prompt)."""

    def __init__(self):
        self.times: list[float] = []
        self.prompt_seen = False

    def put(self, value):
        if self.prompt_seen:
            self.times.append(time.monotonic())
        self.prompt_seen = True

    def end(self):
        pass


def serve_generate(model, reqs: list[Req], batch: int, stop: list[int], pad_id: int, name: str) -> Run:
    """A FIFO server that runs `generate` (DynamicCache, greedy) on up to `batch` waiting requests
    at a time, left-padded; arrivals in real time."""
    order = sorted(reqs, key=lambda r: (r.arrival, r.index))
    state = {"running": 0, "waiting": 0, "kv": 0}
    t0 = time.monotonic() + 0.05
    outcomes = {r.index: Outcome(t0 + r.arrival) for r in reqs}
    queue, i, peak = [], 0, 0
    with Monitor(lambda: (state["running"], state["waiting"], state["kv"], {}), 0.05) as monitor:
        while i < len(order) or queue:
            now = time.monotonic()
            while i < len(order) and t0 + order[i].arrival <= now:
                queue.append(order[i])
                i += 1
            state["waiting"] = len(queue)
            if not queue:
                time.sleep(max(0.0, t0 + order[i].arrival - now))
                continue
            group, queue = queue[:batch], queue[batch:]
            state.update(running=len(group), waiting=len(queue))
            ids, mask = left_pad([r.prompt for r in group], pad_id)
            ids, mask = ids.to(model.device), mask.to(model.device)
            clock, cache = StepClock(), DynamicCache()
            try:
                with torch.inference_mode():
                    out = model.generate(input_ids=ids, attention_mask=mask, past_key_values=cache, do_sample=False,
                                         max_new_tokens=max(r.max_new for r in group), eos_token_id=stop,
                                         pad_token_id=pad_id, streamer=clock)
                peak = max(peak, dynamic_cache_bytes(cache))
                for row, r in enumerate(group):
                    tokens = cut(out[row, ids.shape[1]:].tolist(), stop, r.max_new)
                    o = outcomes[r.index]
                    o.tokens, o.first, o.last = tokens, clock.times[0], clock.times[len(tokens) - 1]
            except Exception as error:  # noqa: BLE001 - a failed call fails its requests, reported
                for r in group:
                    outcomes[r.index].error = repr(error)
            state["running"] = 0
    return Run(name, t0, [outcomes[r.index] for r in reqs], monitor.samples, None, peak)


# ------------------------------------------------------------------------------------ engine

def step_seconds(engine) -> float | None:
    """The engine's time inside steps (its step-duration histogram's sum)."""
    found = re.search(r"^hf_paged_kv_step_duration_seconds_sum (\S+)$", engine.prometheus(), re.M)
    return float(found.group(1)) if found else None


POLL = 0.02  # seconds between the client's looks at its live requests (transformers CB's main loop: the same)


def drive_engine(engine, reqs: list[Req], stop: list[int], t0: float, deadline: float | None = None,
                 max_attempts: int = 8) -> tuple[dict[int, Outcome], int, int]:
    """Submit each request at its arrival time; a refusal (`Overloaded`, at submit or while
    waiting) is retried after its `retry_after`, while attempts and time are left. Returns the
    outcomes, the number of retries and of refusals."""
    pending = [(t0 + r.arrival, r.index, r) for r in reqs]
    heapq.heapify(pending)
    outcomes = {r.index: Outcome(t0 + r.arrival, priority=r.priority) for r in reqs}
    live, retries, refusals = {}, 0, 0

    def refused(r: Req, error: Overloaded, now: float):
        nonlocal retries, refusals
        refusals += 1
        o = outcomes[r.index]
        again = now + error.retry_after
        if o.attempts < max_attempts and (deadline is None or again < deadline):
            o.attempts += 1
            retries += 1
            heapq.heappush(pending, (again, r.index, r))
        else:
            o.refused, o.error = True, f"refused: {error}"

    while pending or live:
        now = time.monotonic()
        while pending and pending[0][0] <= now:
            _, _, r = heapq.heappop(pending)
            try:
                live[r.index] = (r, engine.submit(r.prompt, max_new_tokens=r.max_new, eos_token_id=stop,
                                                  priority=r.priority))
            except Overloaded as error:
                refused(r, error, now)
        for index, (r, handle) in list(live.items()):
            if not handle.done:
                continue
            del live[index]
            o = outcomes[index]
            try:
                o.tokens = handle.result(timeout=0)
                request = handle.request
                o.first, o.last = request.first_token, request.last_token
                if handle.outcome != "finished":
                    o.error = f"outcome {handle.outcome}"
            except Overloaded as error:
                refused(r, error, time.monotonic())
            except Exception as error:  # noqa: BLE001 - a failed request is reported, never fatal
                o.error = repr(error)
        if deadline is not None and now > deadline:
            for index, (r, handle) in live.items():
                handle.cancel()
                outcomes[index].error = "not done by the deadline (cancelled)"
            for _, index, _ in pending:
                outcomes[index].error = "not submitted by the deadline"
            break
        # Until the next arrival, and at most POLL: a request's times are its own (stamped by the
        # engine), so a finished one may wait here a while; a busier loop takes CPU from the engine.
        time.sleep(max(0.0, min(POLL, (pending[0][0] - now) if pending else POLL)))
    return outcomes, retries, refusals


def engine_probe(engine):
    def probe():
        stats = engine.stats()
        extra = {"state": stats["controller"].get("state", "off"),
                 "shed": stats["controller"].get("shed_below_priority", float("-inf")),
                 "batch_tokens": engine.limits.max_batch_tokens, "num_blocks": stats["num_blocks"],
                 "host_bytes": stats.get("host_bytes_used", 0)}
        return stats["requests_running"], stats["requests_waiting"], stats["bytes_used"], extra
    return probe


def serve_engine(model, reqs: list[Req], stop: list[int], size: dict, name: str = "engine",
                 controller: bool = False, slo: SLO | None = None, thresholds: Thresholds | None = None,
                 deadline_after: float | None = None, period: float = 0.05) -> Run:
    """The engine on a fresh pool of `size["num_blocks"]` (and a host tier of `size["host_blocks"]`,
    if given; other `Limits` in `size["limits"]`), the requests submitted in real time."""
    hf_paged_kv.disable(model)
    pool = KVPool(num_blocks=size["num_blocks"], block_size=size["block_size"], host_blocks=size.get("host_blocks"))
    limits = Limits(max_running=size["max_running"], max_batch_tokens=size["batch_tokens"],
                    burst_batch_tokens=size.get("burst_batch_tokens"), ttft_target=size.get("ttft_target"),
                    per_token_target=size.get("per_token_target"), **size.get("limits", {}))
    engine = Engine(model, pool=pool, limits=limits, controller=controller, slo=slo, thresholds=thresholds)
    last = max(r.arrival for r in reqs)
    forwards = []  # (tokens fed, logits kept) of each of the engine's forwards
    hook = model.register_forward_pre_hook(
        lambda _, args, kwargs: forwards.append((kwargs["input_ids"].shape[1], kwargs["logits_to_keep"].numel())),
        with_kwargs=True)
    try:
        with engine:
            t0 = time.monotonic() + 0.05
            deadline = None if deadline_after is None else t0 + last + deadline_after
            with Monitor(engine_probe(engine), period) as monitor:
                outcomes, retries, refusals = drive_engine(engine, reqs, stop, t0, deadline)
    finally:
        hook.remove()
    stats = engine.stats()
    run = Run(name, t0, [outcomes[r.index] for r in reqs], monitor.samples, stats["preemptions"],
              stats["blocks_used_high_water"] * stats["bytes_per_block"], stats["max_running"], step_seconds(engine),
              retries, refusals)
    audit = pool.audit()  # raises on inconsistent bookkeeping
    leaked = audit["references"] - audit["references_by_pins"] - audit["references_by_semantic"]
    run.extra = {"stats": stats, "leaked": leaked, "kv_total": stats["bytes_total"], "forwards": forwards}
    hf_paged_kv.disable(model)
    return run


# ------------------------------------------------------------------- transformers' manager

def cb_config(size: dict) -> ContinuousBatchingConfig:
    return ContinuousBatchingConfig(block_size=size["block_size"], num_blocks=size["num_blocks"],
                                    max_batch_tokens=size["batch_tokens"], max_requests_per_batch=size["max_running"],
                                    cpu_offload_space=size.get("cb_offload_gib", 0.0))


def serve_cb(model, reqs: list[Req], stop: list[int], size: dict, pad_id: int, name: str = "transformers CB",
             deadline_after: float | None = None, period: float = 0.05) -> Run:
    """transformers' ContinuousBatchingManager, streaming; token times taken as its outputs arrive."""
    config = GenerationConfig(do_sample=False, max_new_tokens=max(r.max_new for r in reqs), eos_token_id=stop,
                              pad_token_id=pad_id)
    with torch.no_grad():  # not inference_mode: the manager updates its tensors in place outside it
        manager = model.init_continuous_batching(generation_config=config, continuous_batching_config=cb_config(size))
        manager.warmup()  # builds its paged cache now (on the CPU nothing else happens), before the clock starts
    processor = manager.batch_processor
    per_block = processor.cache.key_cache[0][0].nbytes * 2 * len(processor.cache.key_cache) * size["block_size"]
    offloaded = [0]
    original = processor.offloading_manager.offload_requests

    def counted():
        count = original()
        offloaded[0] += count
        return count

    processor.offloading_manager.offload_requests = counted
    index_of = {f"r{r.index}": r for r in reqs}
    seen: dict[str, int] = {}
    finished: dict[str, object] = {}
    done = threading.Event()
    last = max(r.arrival for r in reqs)
    t0 = time.monotonic() + 0.05
    outcomes = {r.index: Outcome(t0 + r.arrival, priority=r.priority) for r in reqs}

    def consume():
        while not done.is_set():
            result = manager.get_result(timeout=0.05)
            if result is None:
                continue
            now, rid = time.monotonic(), result.request_id
            o = outcomes[index_of[rid].index]
            count = len(result.generated_tokens)
            if count > seen.get(rid, 0):
                seen[rid] = count
                o.first = o.first if o.first is not None else now
                o.last = now
            if result.is_finished():
                finished[rid] = result

    def probe():
        scheduler = processor.scheduler
        used = processor.cache.num_blocks - processor.cache.get_num_free_blocks()
        return (len(scheduler.active_requests), len(scheduler.waiting_requests) + manager.input_queue.qsize(),
                used * per_block, {})

    consumer = threading.Thread(target=consume, daemon=True)
    openmp.release_workers()  # as Engine.start does: this thread's idle OpenMP workers would slow the manager's
    manager.start()
    consumer.start()
    deadline = None if deadline_after is None else t0 + last + deadline_after
    with Monitor(probe, period) as monitor:
        for r in sorted(reqs, key=lambda r: (r.arrival, r.index)):
            time.sleep(max(0.0, t0 + r.arrival - time.monotonic()))
            manager.add_request(input_ids=r.prompt, request_id=f"r{r.index}", max_new_tokens=r.max_new,
                                streaming=True, eos_token_id=stop)
        while len(finished) < len(reqs) and manager.is_running():
            if deadline is not None and time.monotonic() > deadline:
                for rid in index_of:
                    if rid not in finished:
                        manager.cancel_request(rid)
                        outcomes[index_of[rid].index].error = "not done by the deadline (cancelled)"
                break
            time.sleep(0.02)
    done.set()
    consumer.join()
    manager.stop(block=True, timeout=30)
    for rid, r in index_of.items():
        o, result = outcomes[r.index], finished.get(rid)
        if result is None:
            o.error = o.error or "no result (the manager stopped)"
        elif result.error is not None:
            o.error = str(result.error)
        else:
            o.tokens = list(result.generated_tokens)
    peak = max((s[3] for s in monitor.samples), default=0)
    manager.destroy()
    run = Run(name, t0, [outcomes[r.index] for r in reqs], monitor.samples, offloaded[0], peak)
    run.extra = {"kv_total": size["num_blocks"] * per_block}
    return run


# ---------------------------------------------------------------------------- compute floor

def spread(total: int, count: int) -> list[int]:
    """`total` split into `count` near-equal non-negative parts."""
    return [(total * (i + 1)) // count - (total * i) // count for i in range(count)]


def floor_schedules(tokens: int, outputs: list[int], pack: int) -> dict[str, list[tuple[int, int]]]:
    """Ways to feed `tokens` (unique prompt + output tokens) to the model, as `(tokens, logits
    kept)` per forward, no forward over `pack` tokens. "packed": the fewest forwards that hold them,
    which no schedule reaches when one request's output is longer: a request with L output tokens
    needs L forwards, each token after the first being fed back in the next. "even" and "front":
    max(ceil(tokens / pack), longest output) forwards, the fewest any schedule can use, with the
    tokens spread evenly, or in as many full forwards as fit and the rest spread thin (a decode tail)."""
    total_out = sum(outputs)

    def shapes(sizes: list[int], keeps: list[int]) -> list[tuple[int, int]]:
        return [(n, max(1, min(n, k))) for n, k in zip(sizes, keeps)]

    packed = -(-tokens // pack)
    count = max(packed, max(outputs))
    full = min(count - 1, (tokens - count) // (pack - 1))
    tail = spread(tokens - full * pack, count - full)
    tail_out = min(total_out, sum(tail))
    return {
        "packed": shapes(spread(tokens, packed), spread(total_out, packed)),
        "even": shapes(spread(tokens, count), spread(total_out, count)),
        "front": shapes([pack] * full + tail, spread(total_out - tail_out, full) + spread(tail_out, count - full)),
    }


def model_alone_timings(model, reqs: list[Req], output_tokens: int, jobs: dict[tuple, list[tuple[int, int]]]
                        ) -> dict[tuple, float]:
    """Median seconds of `model_alone` for each job (`name -> forwards`), timed where the engine
    runs its steps: on a thread of its own, started with the calling thread's idle OpenMP workers
    released (see `hf_paged_kv.engine.openmp`; the same forwards timed on the client thread came
    out about 10% apart). Each job runs twice, the jobs in one order and then the reverse, so
    that no side of a ratio is always timed first or last."""
    times: dict[tuple, list[float]] = {name: [] for name in jobs}
    failure: list[BaseException] = []

    def run():
        try:
            for order in (list(jobs), list(jobs)[::-1]):
                for name in order:
                    times[name].append(model_alone(model, reqs, output_tokens, jobs[name]))
        except BaseException as error:  # noqa: BLE001 - raised again on the calling thread
            failure.append(error)
        finally:
            openmp.release_workers()

    openmp.release_workers()
    thread = threading.Thread(target=run, name="model-alone")
    thread.start()
    thread.join()
    if failure:
        raise failure[0]
    return {name: statistics.median(t) for name, t in times.items()}


def model_alone(model, reqs: list[Req], output_tokens: int, forwards: list[tuple[int, int]]) -> float:
    """Seconds the model (never enabled, SDPA over each forward's own tokens, no cache) takes for
    `forwards`, each `(tokens, logits kept)`, with positions restarting at the mean length of a
    request's unique prompt and output tokens."""
    mean_len = max(1, (unique_prompt_tokens(reqs) + output_tokens) // len(reqs))
    source = [t for r in reqs for t in r.prompt]
    while len(source) < max(n for n, _ in forwards):
        source += source
    synchronize(model.device)
    started = time.perf_counter()
    with torch.inference_mode():
        for n, keep in forwards:
            ids = torch.tensor(source[:n], device=model.device)[None]
            positions = (torch.arange(n, device=model.device) % mean_len)[None]
            model(input_ids=ids, position_ids=positions, use_cache=False, logits_to_keep=keep)
        synchronize(model.device)
    return time.perf_counter() - started


# ------------------------------------------------------------------------------------ tables

def fmt(x, digits=2) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return f"{x:.{digits}f}"


def mib(n) -> str:
    return f"{n / (1 << 20):.1f}" if n else "-"


def rate_label(rate: float) -> str:
    return "all at once" if math.isinf(rate) else f"{rate:g}/s"


def median_of(summaries: list[dict], key: str):
    values = [s[key] for s in summaries
              if s[key] is not None and not (isinstance(s[key], float) and math.isnan(s[key]))]
    return statistics.median(values) if values else None


def same_column(summaries: list[dict], reference_system: bool, n: int) -> str:
    if reference_system:
        differ = sorted({i for s in summaries for i in s["mismatched"]})
        return "reference" if not differ else f"NO: {len(differ)} of {n} differ between runs"
    differ = sorted({i for s in summaries for i in s["mismatched"]})
    return "yes" if not differ else f"NO: {len(differ)} of {n}"


def parse_rates(text: str) -> list[float]:
    return [float("inf") if part.strip() in ("inf", "all") else float(part) for part in text.split(",") if part.strip()]


# -------------------------------------------------------------------------------------- main

def main() -> int:
    parser = arguments(__doc__.split("\n\n")[0], repeats=None)
    parser.add_argument("--rates", help="arrival rates in requests/s, comma-separated; inf = all at once")
    parser.add_argument("--requests", type=int, help="number of requests (default 64)")
    parser.add_argument("--pool-fraction", type=float, help="pool size as a share of the static reservation")
    parser.add_argument("--batch-tokens", type=int, help="max_batch_tokens of the engine and of transformers' CB")
    parser.add_argument("--plot", help="where the PNG goes (default docs/bench_engine.png; a temp dir in --smoke)")
    parser.add_argument("--device", help="cpu or cuda (default: cuda when there is one)")
    args = parser.parse_args()
    args.repeats = args.repeats or (1 if args.smoke else 3)
    check_repeats(args)
    size = dict(SMOKE if args.smoke else FULL)
    for key in ("requests", "pool_fraction", "batch_tokens", "rates"):
        if getattr(args, key) is not None:
            size[key] = getattr(args, key)
    rates = parse_rates(size["rates"])

    note(f"loading {model_name(args.smoke)} twice (the engine's copy and a never-enabled copy)")
    device = pick_device(args.device)
    plain, model, tokenizer, pad_id, stop = load_pair(args.smoke, device)
    base = workload(tokenizer, size)
    n, bs = len(base), size["block_size"]
    static_blocks = [blocks_for(len(r.prompt) + r.max_new, bs) for r in base]
    size["num_blocks"] = max(math.ceil(size["pool_fraction"] * sum(static_blocks)), max(static_blocks) + 2)
    per_block = bytes_per_block(model, size["num_blocks"], bs)
    budget_tokens = size["num_blocks"] * bs
    widest = max(len(r.prompt) for r in base) + max(r.max_new for r in base)
    micro = max(1, min(size["max_micro"], budget_tokens // widest))
    static_concurrency = size["num_blocks"] / statistics.mean(static_blocks)

    systems = {
        "sequential generate": lambda reqs: serve_generate(plain, reqs, 1, stop, pad_id, "sequential generate"),
        f"micro-batches of {micro}": lambda reqs: serve_generate(plain, reqs, micro, stop, pad_id,
                                                                 f"micro-batches of {micro}"),
        "transformers CB": lambda reqs: serve_cb(plain, reqs, stop, size, pad_id),
        "engine": lambda reqs: serve_engine(model, reqs, stop, size),
    }
    names = list(systems)
    note(f"{n} requests, pool {size['num_blocks']} blocks of {bs} ({mib(size['num_blocks'] * per_block)} MiB), "
         f"micro-batches of {micro}, rates {[rate_label(r) for r in rates]}")

    warm = poisson(base[: size["warmup"]], float("inf"), 0)
    for name in names:
        note(f"warm-up: {name}")
        systems[name](warm)

    results = {rate: {name: [] for name in names} for rate in rates}
    floors: list[dict[str, float]] = []
    reference = None
    for round_ in range(args.repeats):
        for k, rate in enumerate(rates):
            reqs = poisson(base, rate, seed=1000 + k)
            shift = (round_ + k) % len(names)
            for name in names[shift:] + names[:shift]:
                note(f"run {round_ + 1}/{args.repeats}, rate {rate_label(rate)}: {name}")
                results[rate][name].append(systems[name](reqs))
        if reference is None:  # sequential generate of one request at a time = per-request greedy generate
            first = next(run for rate in rates for run in results[rate][names[0]])
            reference = [o.tokens for o in first.outcomes]
        outputs = [len(t) for t in reference if t is not None]
        output_tokens = sum(outputs)
        note(f"run {round_ + 1}/{args.repeats}: compute floors, and the model alone on the engine's forwards")
        schedules = floor_schedules(unique_prompt_tokens(base) + output_tokens, outputs, size["batch_tokens"])
        jobs = {("floor", name): forwards for name, forwards in schedules.items()}
        jobs |= {("engine", rate): results[rate]["engine"][-1].extra["forwards"] for rate in rates}
        timed = model_alone_timings(plain, base, output_tokens, jobs)
        floors.append({name: timed["floor", name] for name in schedules}
                      | {"replay": min(timed["engine", rate] for rate in rates)})
        for rate in rates:
            results[rate]["engine"][-1].extra["model_alone"] = timed["engine", rate]

    checks = Checks()
    checks.expect(all(t is not None for t in reference), "sequential generate failed a request: no reference")
    summaries = {rate: {name: [summarize(run, reference) for run in results[rate][name]] for name in names}
                 for rate in rates}
    for rate in rates:
        for run, s in zip(results[rate]["engine"], summaries[rate]["engine"]):
            checks.expect(not s["mismatched"], f"engine at {rate_label(rate)}: {len(s['mismatched'])} requests' tokens "
                                               f"differ from per-request generate (requests {s['mismatched'][:8]})")
            checks.expect(s["failed"] == 0, f"engine at {rate_label(rate)}: {s['failed']} requests failed")
            checks.expect(run.extra["leaked"] == 0, f"engine at {rate_label(rate)}: {run.extra['leaked']} blocks "
                                                    "still in use after every request finished")

    image = "" if checks.failures else plot(args, rates, names, summaries)
    body = report(args, size, base, rates, names, summaries, results, floors, reference, micro, static_concurrency,
                  per_block, image)
    return checks.finish("engine", body, args.smoke)


def report(args, size, base, rates, names, summaries, results, floors, reference, micro, static_concurrency,
           per_block, image: str = "") -> str:
    """The section's text; `image`: the plot's markdown link, set next to the tables it draws."""
    n, bs = len(base), size["block_size"]
    prompt_tokens = sum(len(r.prompt) for r in base)
    outputs = [len(t) for t in reference if t is not None]
    output_tokens = sum(outputs)
    pool_bytes = size["num_blocks"] * per_block
    lines = [
        f"### Serving engine: {n} requests, Poisson arrivals ({model_name(args.smoke)}, fp32, "
        f"{device_name(pick_device(args.device))})",
        "",
        f"Workload: {n} requests of real text, prompts of {min(len(r.prompt) for r in base)}..."
        f"{max(len(r.prompt) for r in base)} tokens ({prompt_tokens} in all, {unique_prompt_tokens(base)} once the "
        f"shared {size['system_tokens']}-token system prompt of {sum(1 for r in base if r.group)} requests is counted "
        f"once); max_new_tokens {size['new'][0]}..{size['new'][1]} per request, each stopping at the end of its first "
        f"sentence: {output_tokens} tokens generated in all.",
        "",
        f"Same KV memory for every system: {size['num_blocks']} blocks of {bs} tokens = {mib(pool_bytes)} MiB "
        f"({size['pool_fraction']:.0%} of what the requests would reserve statically, prompt + max_new_tokens each; "
        "not all fit at once). The systems:",
        "",
        "- sequential and micro-batched `generate`: DynamicCache (a model never enabled); micro-batches take up to "
        f"{micro} waiting requests (the largest padded DynamicCache batch that fits the same bytes);",
        f"- the engine: `Engine(max_running={size['max_running']}, max_batch_tokens={size['batch_tokens']}, "
        "controller=False)` on a fresh pool per run;",
        f"- transformers CB: `ContinuousBatchingConfig(num_blocks={size['num_blocks']}, block_size={bs}, "
        f"max_batch_tokens={size['batch_tokens']}, max_requests_per_batch={size['max_running']})`, streaming, prefix "
        "sharing on, its token times taken as its outputs reach the client.",
    ]
    header = ["system", "tokens/s", "vs sequential", "TTFT p50 s", "TTFT p95 s", "per-token p50 s", "per-token p95 s",
              "max / mean concurrent", "preemptions", "peak KV MiB", "failed", "same tokens as per-request generate"]
    for rate in rates:
        rows = []
        seq = median_of(summaries[rate][names[0]], "throughput")
        for name in names:
            s = summaries[rate][name]
            thr = median_of(s, "throughput")
            pre = median_of(s, "preemptions")
            rows.append([name, fmt(thr, 1), f"{thr / seq:.2f}x" if thr and seq else "-",
                         fmt(median_of(s, "ttft_p50")), fmt(median_of(s, "ttft_p95")),
                         fmt(median_of(s, "tok_p50"), 3), fmt(median_of(s, "tok_p95"), 3),
                         f"{median_of(s, 'max_running'):.0f} / {median_of(s, 'mean_running'):.1f}",
                         "-" if pre is None else f"{pre:.0f}", mib(median_of(s, "peak_kv")),
                         f"{max(x['failed'] for x in s)}", same_column(s, name == names[0], n)])
        lines += ["", f"**Arrivals {rate_label(rate)}** (makespan of the engine "
                      f"{median_of(summaries[rate]['engine'], 'makespan'):.1f} s):", "", markdown_table(header, rows)]
    if image:
        lines += ["", image]

    # ratios against the targets, at every rate
    engine = {rate: median_of(summaries[rate]["engine"], "throughput") for rate in rates}
    rows = []
    for name, target in zip(names[:3], ("3x", "1.5x", "1.5x")):
        rows.append([f"engine vs {name}", *[
            f"{engine[rate] / median_of(summaries[rate][name], 'throughput'):.2f}x" for rate in rates], target])
    shapes = floor_schedules(unique_prompt_tokens(base) + output_tokens, outputs, size["batch_tokens"])
    # a schedule the engine ran is one any system could: a "floor" above its replay is not one
    floor = statistics.median(min(f["even"], f["front"], f["replay"]) for f in floors)
    spreads = statistics.median(min(f["even"], f["front"]) for f in floors)
    packed = statistics.median(f["packed"] for f in floors)
    busy = {rate: median_of(summaries[rate]["engine"], "busy") for rate in rates}
    makespan = {rate: median_of(summaries[rate]["engine"], "makespan") for rate in rates}
    rows.append(["engine makespan / compute floor", *[f"{makespan[rate] / floor:.2f}x" for rate in rates],
                 "<= 1.3x"])
    rows.append(["engine time in steps / compute floor",
                 *[f"{busy[rate] / floor:.2f}x" if busy[rate] else "-" for rate in rates], ""])
    alone = {rate: median_of(summaries[rate]["engine"], "model_alone") for rate in rates}
    rows.append(["of which: the model alone on the engine's forwards / compute floor (the schedule)",
                 *[f"{alone[rate] / floor:.2f}x ({median_of(summaries[rate]['engine'], 'forwards'):.0f} forwards "
                   f"vs {len(shapes['even'])})" if alone[rate] else "-" for rate in rates], ""])
    rows.append(["and: engine time in steps / the model alone on its forwards (the engine's own cost)",
                 *[f"{busy[rate] / alone[rate]:.2f}x" if busy[rate] and alone[rate] else "-" for rate in rates], ""])
    rows.append([f"engine time in steps / the packed floor ({len(shapes['packed'])} forwards, unreachable)",
                 *[f"{busy[rate] / packed:.2f}x" if busy[rate] else "-" for rate in rates], ""])
    lines += ["", "**Throughput ratios** (medians of this run) and the compute floor:", "",
              markdown_table(["ratio", *[rate_label(r) for r in rates], "target"], rows), "",
              f"Compute floor: {floor:.2f} s (the spreads {spreads:.2f} s): the model alone (never enabled, SDPA) "
              f"on the {unique_prompt_tokens(base)} unique prompt tokens and the {output_tokens} output tokens in the "
              f"cheapest of the schedules below, forwards of at most {size['batch_tokens']} tokens.", "",
              f"- {len(shapes['even'])} forwards is the fewest any schedule can use: no forward holds more than "
              f"{size['batch_tokens']} tokens, and a request with L output tokens needs L forwards, since each "
              f"token after its first is fed back in the next one (the longest output here is {max(outputs)} "
              "tokens).",
              "- The floor is the cheapest of two spreads of the tokens over those forwards (evenly, or as many full "
              "forwards as fit and the rest spread thin) and the engine's own forwards at any rate, replayed. A "
              "schedule the engine ran is one any system could; and the model alone runs each forward as one causal "
              "sequence, so a spread's larger forwards also attend across requests, which no real schedule does. "
              "Where a replay is the floor, the schedule's row reads 1.00x at that rate by construction.",
              "- Every forward of a floor: positions restarting per sequence, logits only for the output tokens; a "
              "replay feeds what the engine fed (no request's last token, prefixes shared by whole blocks, any "
              "recompute after a preemption).",
              f"- The packed floor, {packed:.2f} s, puts the same tokens in {len(shapes['packed'])} full forwards, "
              "which ignores that dependency: unreachable, a row for comparison.", "",
              "Reading the ratios:", "",
              "- The makespan ratio at the lower rates is bounded by the arrivals (the last request arrives late); "
              "the step-time ratio is not.",
              "- The step-time ratio splits in two. First, the model alone replaying the engine's own forwards of "
              "each round's engine runs, against the floor: what running more, smaller forwards costs (a decode step "
              "feeds one token per running sequence, and the pool bounds how many run). The replay takes each "
              "forward's token count and kept logits, recorded by a forward pre-hook; no cache, SDPA over the "
              "forward's own tokens.",
              "- Second, the engine's time in steps against that replay: attention over cached keys, cache writes, "
              "planning and sampling.",
              "- The floors and the replays are timed after each round, where the engine runs its steps: on a thread "
              "of their own started with the client thread's OpenMP workers released; each twice, all of them in "
              "one order and then the reverse, median per round, then median over the rounds."]

    ceiling = concurrency_ceiling(base, size["num_blocks"], bs)
    rows = []
    for rate in rates:
        s = summaries[rate]["engine"]
        mx, mean = median_of(s, "max_running"), median_of(s, "mean_running")
        rows.append([rate_label(rate), f"{static_concurrency:.1f}", f"{ceiling} ({ceiling / static_concurrency:.1f}x)",
                     f"{mx:.0f} ({mx / static_concurrency:.1f}x)",
                     f"{mean:.1f} ({mean / static_concurrency:.1f}x)",
                     f"{median_of(summaries[rate]['transformers CB'], 'max_running'):.0f}"])
    lines += ["", "**Concurrency at the same memory** (target: the engine >= 3x a static reservation):", "",
              markdown_table(["arrivals", "static reservation (prompt + max_new_tokens each)",
                              "ceiling (prompts + 1 token each, shared prefix once)", "engine max",
                              "engine mean (over the makespan)", "transformers CB max"], rows), "",
              f"Static reservation: {size['num_blocks']} blocks / the mean reservation of "
              f"{statistics.mean(blocks_for(len(r.prompt) + r.max_new, bs) for r in base):.1f} blocks per request. "
              f"Ceiling: the most requests whose prompts and first tokens fit in the pool at once (smallest first, "
              f"the shared system prompt's full blocks stored once), a bound for any system: where it is below 3x the "
              f"static reservation, the 3x target cannot be met on this workload at this memory. "
              "Concurrent sequences are sampled every 50 ms (the engine's max is its exact high-water mark); the mean "
              "is over the makespan."]
    lines += ["", f"Method: each system serves the same seeded trace in real time in one process (client and server on "
                  f"this machine, {torch.get_num_threads()} torch threads); one untimed warm-up run of each system on "
                  f"{size['warmup']} requests first; then {args.repeats} round{'s' if args.repeats > 1 else ''}, "
                  "each running every rate with the systems' order rotated per round and rate; every figure is the "
                  "median over the rounds, every ratio compares medians of this run.", "",
              "- Time to first token counts from the scheduled arrival; per-token latency is per request (last - "
              "first token) / (tokens - 1), then p50/p95 over requests.",
              "- Tokens of every run are compared with per-request greedy `generate` (sequential, DynamicCache).",
              "- The engine and transformers CB run their steps on a thread of their own, and each starts with the "
              "client thread's idle OpenMP workers released (`hf_paged_kv.engine.openmp`: with more OpenMP threads "
              "than cores every parallel region pays a wake-up); the generate systems run on the client thread.",
              f"- The engine's client looks at its live requests every {POLL * 1000:.0f} ms and sleeps in between; "
              "the engine stamps each request's token times itself."]
    return "\n".join(lines)


def plot(args, rates, names, summaries) -> str:
    """Throughput and p95 TTFT against the arrival rate per system: docs/bench_engine.png (a temp
    dir in smoke runs). Returns the markdown that shows it."""
    path = common.plot_path(args, "bench_engine")
    import matplotlib.pyplot as plt
    x = np.arange(len(rates))
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6.5), sharex=True)
    for name in names:
        top.plot(x, [median_of(summaries[r][name], "throughput") for r in rates], marker="o", label=name)
        bottom.plot(x, [median_of(summaries[r][name], "ttft_p95") for r in rates], marker="o", label=name)
    top.set_ylabel("generated tokens/s")
    top.set_title("Throughput and p95 time to first token vs arrival rate")
    bottom.set_ylabel("TTFT p95 (s)")
    bottom.set_yscale("log")
    bottom.set_xticks(x, [rate_label(r) for r in rates])
    bottom.set_xlabel("arrival rate (Poisson, requests/s)")
    top.legend(fontsize=8)
    for axis in (top, bottom):
        axis.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    note(f"plot: {path}")
    shown = path.name if path.parent.resolve() == common.BENCHMARKS_MD.parent.resolve() else str(path)
    return f"![throughput and p95 TTFT vs arrival rate]({shown})"


if __name__ == "__main__":
    sys.exit(main())
