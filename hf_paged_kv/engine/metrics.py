"""The engine's Prometheus metrics, through `prometheus_client` (one registry per engine).

    >>> print(engine.prometheus())       # text exposition format, also served at /metrics
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 120)
SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


class EngineMetrics:
    def __init__(self):
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
        self.requests = counter("requests", "Finished requests by outcome", ["outcome"])
        self.preemptions = counter("preemptions", "Preemptions by mode", ["mode"])
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens by where their KV came from", ["source"])
        self.generated = counter("generated_tokens", "Tokens generated")
        self.controller_actions = counter("controller_actions", "Load-controller decisions", ["knob"])
        self.ttft = histogram("time_to_first_token_seconds", "Submission to first token")
        self.itl = histogram("inter_token_latency_seconds", "Between consecutive tokens of a request")
        self.e2e = histogram("e2e_latency_seconds", "Submission to last token")
        self.queue = histogram("queue_time_seconds", "Submission to admission")
        self.step = histogram("step_duration_seconds", "One scheduler step: plan, forward, sample")
        self.batch_tokens = histogram("batch_tokens", "Tokens per forward", SIZE_BUCKETS)
        self.batch_sequences = histogram("batch_sequences", "Sequences per forward", SIZE_BUCKETS)

    def observe_pool(self, stats: dict) -> None:
        total = max(stats["num_blocks"], 1)
        self.kv_usage.set(stats["blocks_used"] / total)
        for state in ("free", "used", "cached"):
            self.blocks.labels(state).set(stats[f"blocks_{state}"])
        self.host_blocks.set(stats.get("host_blocks_used", 0))

    def text(self) -> str:
        return generate_latest(self.registry).decode()
