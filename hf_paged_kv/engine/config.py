"""The serving engine's settings.

`EngineConfig` holds what a user tunes, each with its unit and default; `python -m
hf_paged_kv.serve` maps its flags onto it one to one, with vLLM's names where the meaning is the
same. `SLO` is the service-level targets that switch load adaptation on. `Limits` is what the
scheduler and its rules read while the engine runs (the engine builds it from the config; the
load controller moves some of it); setting it directly is for experiments.

    config = EngineConfig(max_num_seqs=32, max_num_batched_tokens=256, slo=SLO(ttft=1.0, per_token=0.1))
    engine = Engine(model, tokenizer=tokenizer, pool=KVPool(num_blocks=512), config=config)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

BACKENDS = ("auto", "torch", "triton")


@dataclass(frozen=True)
class SLO:
    """Service-level targets: seconds to the first token, seconds between tokens."""

    ttft: float = 2.0
    per_token: float = 0.5

    def __post_init__(self):
        if not (0 < self.ttft < math.inf and 0 < self.per_token < math.inf):
            raise ValueError(f"SLO targets must be finite numbers of seconds > 0, got ttft={self.ttft}, "
                             f"per_token={self.per_token}")


@dataclass(frozen=True)
class EngineConfig:
    """What a user tunes in the serving engine.

    Attributes:
        max_num_seqs: sequences running at once, at most (`--max-num-seqs`). Default 64.
        max_num_batched_tokens: tokens one forward holds: every running decode, then prefill
            chunks and new prompts in what is left (`--max-num-batched-tokens`). Default 512.
        max_waiting: requests queued for admission; one more is refused with `Overloaded`
            (HTTP 429) (`--max-waiting`). Default 1024.
        max_model_len: tokens one request may hold, prompt + `max_new_tokens`; None: the model's
            own limit (its context, or where its RoPE starts to scale with length)
            (`--max-model-len`). Default None.
        slo: service-level targets in seconds (`--slo-ttft`, `--slo-tpot`); given, the engine
            adapts to load against them (and may shed); None: nothing is shed or paced.
        backend: attention backend when the engine enables the model: "torch", "triton", or
            "auto" (Triton on CUDA, torch otherwise). Default "auto".
        served_model_name: the `model_name` label of the vLLM-named metrics
            (`--served-model-name`); None: the model's `name_or_path`, or "model".
    """

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_waiting: int = 1024
    max_model_len: int | None = None
    slo: SLO | None = None
    backend: str = "auto"
    served_model_name: str | None = None

    def __post_init__(self):
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_waiting", "max_model_len"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"EngineConfig.{name} must be an integer >= 1, got {value!r}")
        if self.slo is not None and not isinstance(self.slo, SLO):
            raise ValueError(f"EngineConfig.slo must be an SLO(ttft=..., per_token=...) or None, got {self.slo!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"EngineConfig.backend must be one of {BACKENDS}, got {self.backend!r}")


@dataclass
class Limits:
    """What the scheduler and its rules read while the engine runs (the load controller moves
    some of them). The engine builds it from its `EngineConfig`."""

    max_running: int = 64
    # tokens a forward holds: every running decode always runs (beyond this if max_running is
    # larger), prefill chunks and new prompts take what is left
    max_batch_tokens: int = 512
    max_waiting: int = 1024  # beyond this, submit sheds load (Overloaded)
    watermark: float = 0.0  # fraction of the pool admissions leave free
    # s; set: a partial prompt chunk waits rather than delay a forward's first tokens (see
    # scheduler), and a forward may grow to give first tokens in time (see pacing)
    ttft_target: float | None = None
    per_token_target: float | None = None  # s; set: forwards carrying decodes are paced (see pacing)
    # with ttft_target, a forward may hold up to this many tokens (at least max_batch_tokens) where
    # only one forward that large gives the prompts in line their first tokens in time (see pacing);
    # None: max_batch_tokens. The load controller sets twice the budget's configured value, its
    # budget knob's bound, and follows that value when a user changes it
    burst_batch_tokens: int | None = None
    demote_ahead: float = 0.0  # with a host tier, keep this fraction of the pool free by demoting cold blocks
    growth_ratio_init: float = 0.7
    growth_ratio_min: float = 0.1
    growth_ratio_decay: float = 0.002  # per step while nothing is preempted
    # cap the share by the mean share of their allowance that finished requests generated (see
    # growth); False: SGLang's decaying share alone
    growth_from_outputs: bool = True
    # the most of a request's remaining max_new_tokens the reserve counts (as SGLang clips it): a
    # server's default of "the rest of the context" would reserve thousands of tokens per request
    # for outputs that mostly stop early; a sequence that does outgrow its reserve preempts another.
    # None: no clip, neither this one nor MAX_GROWTH_SHARE (a static reservation, with ratio 1)
    growth_clip: int | None = 4096

    def __post_init__(self):
        for name in ("max_running", "max_batch_tokens", "max_waiting", "growth_clip", "burst_batch_tokens"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"Limits.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("growth_ratio_decay",):
            if getattr(self, name) < 0:
                raise ValueError(f"Limits.{name} must be >= 0, got {getattr(self, name)}")
        for name in ("watermark", "demote_ahead", "growth_ratio_init", "growth_ratio_min"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"Limits.{name} is a fraction in [0, 1], got {getattr(self, name)}")
        for name, without in (("ttft_target", "no target-driven admission"), ("per_token_target", "no pacing")):
            value = getattr(self, name)
            if value is not None and not 0 < value < math.inf:  # NaN fails the comparison too
                raise ValueError(f"Limits.{name} must be a finite number of seconds > 0 (or None: {without}), "
                                 f"got {value}")
        if self.burst_batch_tokens is not None and self.burst_batch_tokens < self.max_batch_tokens:
            raise ValueError(f"Limits.burst_batch_tokens is the most a forward may hold past max_batch_tokens: "
                             f"at least max_batch_tokens ({self.max_batch_tokens}), got {self.burst_batch_tokens} "
                             f"(None: no forward past max_batch_tokens)")
