"""What the engine counts: the counters of `engine.stats()` and the Prometheus metrics, through
`prometheus_client` (one registry per engine), updated together.

    >>> print(engine.prometheus())       # text exposition format, also served at /metrics
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
    def __init__(self):
        self.counters = dict.fromkeys(COUNTERS, 0)
        self.lock = threading.Lock()  # a refusal counts on the client's thread, the rest on the engine's
        self.registry = registry = CollectorRegistry()

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

    def admitted(self, request) -> None:
        """A request's first admission (a preempted one coming back waited once)."""
        self.queue.observe(request.admitted - request.arrived)

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
        else:
            self.itl.observe(now - request.last_token)

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

    # ----------------------------------------------------------- levels
    def observe(self, stats: dict) -> None:
        """Set the gauges from `Engine.stats()`."""
        self.running.set(stats["requests_running"])
        self.waiting.set(stats["requests_waiting"])
        self.kv_usage.set(stats["blocks_used"] / max(stats["num_blocks"], 1))
        for state in ("free", "used", "cached"):
            self.blocks.labels(state).set(stats[f"blocks_{state}"])
        self.host_blocks.set(stats.get("host_blocks_used", 0))
        for gauge, value in ((self.goodput, stats["goodput"]), (self.availability, stats["availability"])):
            gauge.set(math.nan if value is None else value)  # no SLO targets: nothing to be within
        self.growth.set(stats["growth_ratio"])

    def text(self) -> str:
        return generate_latest(self.registry).decode()
