"""What the engine counts: the counters of `engine.stats()` and the Prometheus metrics, through
`prometheus_client` (one registry per engine), updated together.

    >>> print(engine.prometheus())       # text exposition format, also served at /metrics

The project's own metrics are named `hf_paged_kv_*`. Where a figure means what one of vLLM's
does, it is also exported under vLLM's name and labels (`vllm:*`, labelled `model_name`), so
that the dashboards and alerts people have for vLLM read this server too.
"""

from __future__ import annotations

import math
import threading

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 120)
SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
OUTCOMES = ("finished", "rejected", "cancelled", "failed")
COUNTERS = (*(f"requests_{outcome}" for outcome in OUTCOMES), "preemptions",
            "max_running", "tokens_prefilled", "tokens_inherited",
            "tokens_recomputed", "tokens_generated", "steps", "controller_faults")


class EngineMetrics:
    def __init__(self, model_name: str = "model"):
        self.counters = dict.fromkeys(COUNTERS, 0)
        self.lock = threading.Lock()  # a refusal counts on the client's thread, the rest on the engine's
        self.registry = registry = CollectorRegistry()
        self.vllm = VLLMMetrics(registry, model_name)

        def gauge(name, doc, labels=()):
            return Gauge(f"hf_paged_kv_{name}", doc, labels, registry=registry)

        def counter(name, doc, labels=()):
            return Counter(f"hf_paged_kv_{name}", doc, labels, registry=registry)

        def histogram(name, doc, buckets=LATENCY_BUCKETS):
            return Histogram(f"hf_paged_kv_{name}", doc, buckets=buckets, registry=registry)

        self.running = gauge("requests_running", "Requests with a sequence in the pool")
        self.waiting = gauge("requests_waiting", "Requests queued for admission")
        self.kv_usage = gauge("kv_usage_ratio", "Device blocks in use (not free, not merely cached) / pool size")
        self.blocks = gauge("kv_blocks", "Device blocks by state", ["state"])
        self.host_blocks = gauge("kv_host_blocks_used", "Blocks held by the host tier")
        self.knobs = gauge("controller_setting", "Current value of each load-controller actuator", ["knob"])
        self.controller_state = gauge("controller_state", "Load controller state (1 for the current one)", ["state"])
        self.goodput = gauge("goodput_requests_per_second", "Requests within the SLO targets per second since the engine's first start")
        self.availability = gauge("availability_ratio", "Requests within the SLO targets / requests submitted")
        self.growth = gauge("growth_ratio", "Share of the running sequences' remaining max_new_tokens that admission keeps free")
        self.requests = counter("requests", "Finished requests by outcome", ["outcome"])
        for outcome in OUTCOMES:  # every series from the start, at 0: a rate() or an alert on it works at once
            self.requests.labels(outcome)
        self.preemptions = counter("preemptions", "Running sequences sent back to the queue because memory ran out, "
                                   "by how their partial last block is kept (swap or recompute)", ["mode"])
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens by where their KV came from (recomputed: "
                                     "computed again after a preemption)", ["source"])
        self.generated = counter("generated_tokens", "Tokens generated")
        self.controller_actions = counter("controller_actions", "Load-controller decisions", ["knob"])
        self.controller_faults = counter("controller_faults", "Load-controller ticks that raised (the first is "
                                         "logged; the knobs keep their values)")
        self.ttft = histogram("time_to_first_token_seconds", "Submission to first token")
        self.itl = histogram("inter_token_latency_seconds", "Between consecutive tokens of a request")
        self.e2e = histogram("e2e_latency_seconds", "Submission to last token")
        self.queue = histogram("queue_time_seconds", "Submission to admission")
        self.step = histogram("step_duration_seconds", "One scheduler step: plan, forward, sample")
        self.batch_tokens = histogram("batch_tokens", "Tokens per forward", SIZE_BUCKETS)
        self.batch_sequences = histogram("batch_sequences", "Sequences per forward", SIZE_BUCKETS)

    # ---------------------------------------------------------- events
    def count(self, name: str, amount: int = 1) -> None:
        with self.lock:
            self.counters[name] += amount

    def rejected(self) -> None:
        """A request refused at submit."""
        self.count("requests_rejected")
        self.requests.labels("rejected").inc()

    def ended(self, request, outcome: str) -> None:
        self.count(f"requests_{outcome}")
        self.requests.labels(outcome).inc()
        if outcome == "finished":
            self.e2e.observe(request.finished - request.arrived)
        self.vllm.ended(request, outcome)

    def admitted(self, request) -> None:
        """A request's first admission (a preempted one coming back waited once)."""
        self.queue.observe(request.admitted - request.arrived)
        self.vllm.admitted(request)

    def inherited(self, tokens: int) -> None:
        """Prompt tokens an admission inherited that no forward of the request computed."""
        self.count("tokens_inherited", tokens)
        self.prompt_tokens.labels("inherited").inc(tokens)

    def token(self, request, now: float) -> None:
        """A token generated for `request` at `now`, before the request records it."""
        self.count("tokens_generated")
        self.generated.inc()
        if request.first_token is None:
            self.ttft.observe(now - request.arrived)
            self.vllm.ttft.observe(now - request.arrived)
        else:
            self.itl.observe(now - request.last_token)
            self.vllm.itl.observe(now - request.last_token)
        self.vllm.generation_tokens.inc()

    def forward(self, batch, first: int, again: int, running: int) -> None:
        """A forward of `batch` ((request, tokens) rows) that ran: `first` prompt tokens computed
        for the first time, `again` after a preemption, with `running` sequences running."""
        self.count("tokens_prefilled", first)
        self.count("tokens_recomputed", again)
        self.prompt_tokens.labels("computed").inc(first)
        self.prompt_tokens.labels("recomputed").inc(again)
        with self.lock:
            self.counters["max_running"] = max(self.counters["max_running"], running)
        self.batch_tokens.observe(sum(n for _, n in batch))
        self.batch_sequences.observe(len(batch))

    def controller_fault(self) -> bool:
        """A tick of the load controller raised; returns whether it is the first."""
        self.count("controller_faults")
        self.controller_faults.inc()
        return self.counters["controller_faults"] == 1

    def stepped(self, seconds: float) -> None:
        self.count("steps")
        self.step.observe(seconds)

    def preempted(self, mode: str) -> None:
        self.count("preemptions")
        self.preemptions.labels(mode).inc()
        self.vllm.preemptions.inc()

    # ----------------------------------------------------------- levels
    def observe(self, stats: dict) -> None:
        """Set the gauges from `Engine.stats()`."""
        self.running.set(stats["requests_running"])
        self.waiting.set(stats["requests_waiting"])
        self.kv_usage.set(stats["blocks_used"] / max(stats["num_blocks"], 1))
        self.vllm.observe(stats)
        for state in ("free", "used", "cached"):
            self.blocks.labels(state).set(stats[f"blocks_{state}"])
        self.host_blocks.set(stats.get("host_blocks_used", 0))
        for gauge, value in ((self.goodput, stats["goodput"]), (self.availability, stats["availability"])):
            gauge.set(math.nan if value is None else value)  # no SLO targets: nothing to be within
        self.growth.set(stats["growth_ratio"])

    def text(self) -> str:
        return generate_latest(self.registry).decode()


class VLLMMetrics:
    """The figures that mean what vLLM's do, under vLLM's names, labelled `model_name`."""

    def __init__(self, registry: CollectorRegistry, model_name: str):
        label = {"model_name": model_name}

        def labelled(kind, name, doc, **options):
            return kind(f"vllm:{name}", doc, ["model_name"], registry=registry, **options).labels(**label)

        self.running = labelled(Gauge, "num_requests_running", "Requests running (a sequence in the pool)")
        self.waiting = labelled(Gauge, "num_requests_waiting", "Requests waiting for admission")
        self.kv_usage = labelled(Gauge, "kv_cache_usage_perc", "KV-cache usage: 1 is full")
        self.prefix_queries = labelled(Counter, "prefix_cache_queries", "Prompt tokens looked up in the prefix cache")
        self.prefix_hits = labelled(Counter, "prefix_cache_hits", "Prompt tokens the prefix cache held")
        self.prompt_tokens = labelled(Counter, "prompt_tokens", "Prompt tokens of the requests admitted")
        self.generation_tokens = labelled(Counter, "generation_tokens", "Tokens generated")
        self.preemptions = labelled(Counter, "num_preemptions", "Preemptions")
        self.success = Counter("vllm:request_success", "Requests that ended, by finish reason",
                               ["model_name", "finished_reason"], registry=registry)
        self.reasons = {reason: self.success.labels(model_name, reason) for reason in ("stop", "length", "abort")}
        self.ttft = labelled(Histogram, "time_to_first_token_seconds", "Submission to first token",
                             buckets=LATENCY_BUCKETS)
        self.itl = labelled(Histogram, "inter_token_latency_seconds", "Between consecutive tokens",
                            buckets=LATENCY_BUCKETS)
        self.e2e = labelled(Histogram, "e2e_request_latency_seconds", "Submission to end", buckets=LATENCY_BUCKETS)
        self.queue = labelled(Histogram, "request_queue_time_seconds", "Submission to admission",
                              buckets=LATENCY_BUCKETS)
        self.prompt_lengths = labelled(Histogram, "request_prompt_tokens", "Prompt tokens per request",
                                       buckets=SIZE_BUCKETS)
        self.generation_lengths = labelled(Histogram, "request_generation_tokens", "Generated tokens per request",
                                           buckets=SIZE_BUCKETS)

    def admitted(self, request) -> None:
        """A request's first admission: its prompt, and how much of it the prefix cache held."""
        self.queue.observe(request.admitted - request.arrived)
        self.prompt_tokens.inc(len(request.prompt))
        self.prefix_queries.inc(len(request.prompt))
        self.prefix_hits.inc(min(request.inherited, len(request.prompt)))

    def ended(self, request, outcome: str) -> None:
        """vLLM counts the requests that finish by stop, length or abort; failed and rejected
        ones are not successes."""
        reason = finish_reason(request, outcome)
        if reason is None:
            return
        self.reasons[reason].inc()
        if reason != "abort":
            self.e2e.observe(request.finished - request.arrived)
            self.prompt_lengths.observe(len(request.prompt))
            self.generation_lengths.observe(len(request.generated))

    def observe(self, stats: dict) -> None:
        self.running.set(stats["requests_running"])
        self.waiting.set(stats["requests_waiting"])
        self.kv_usage.set(stats["blocks_used"] / max(stats["num_blocks"], 1))


def finish_reason(request, outcome: str) -> str | None:
    """vLLM's `finished_reason` of a request that ended with `outcome`: "stop" (an end token, or
    its reader stopping it at a stop string), "length", "abort" (cancelled); None otherwise."""
    if outcome == "cancelled":
        return "abort"
    if outcome != "finished":
        return None
    params, generated = request.params, request.generated
    if generated and generated[-1] in params.eos_token_id or request.cancel_requested == "finished":
        return "stop"
    return "length"
