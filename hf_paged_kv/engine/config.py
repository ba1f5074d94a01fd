"""The engine's knobs: `Limits`, what the scheduler and its rules read (the load controller moves
some of them while it runs)."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class Limits:
    """The scheduler's knobs (the load controller moves some of them)."""

    max_running: int = 64
    # tokens a forward holds: every running decode always runs (beyond this if max_running is
    # larger), prefill chunks and new prompts take what is left
    max_batch_tokens: int = 512
    max_waiting: int = 1024  # beyond this, submit sheds load (Overloaded)
    watermark: float = 0.0  # fraction of the pool admissions leave free
    backfill_wait: float = 1.0  # s a request memory turns away lets later ones of its priority that fit pass it
    # s; set: a partial prompt chunk waits rather than delay a forward's first tokens (see
    # scheduler), and a forward may grow to give first tokens in time (see pacing)
    ttft_target: float | None = None
    per_token_target: float | None = None  # s; set: forwards carrying decodes are paced (see pacing)
    # with ttft_target, a forward may hold up to this many tokens (at least max_batch_tokens) where
    # only one forward that large gives the prompts in line their first tokens in time (see pacing);
    # None: max_batch_tokens. The load controller sets twice the budget's configured value, its
    # budget knob's bound, and follows that value when a user changes it
    burst_batch_tokens: int | None = None
    prefetch_depth: int = 2  # waiting requests whose prefixes come back from host/disk ahead of their turn
    prefetch_watermark: float = 0.1  # prefetch uses only free blocks beyond this fraction of the pool
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
        for name in ("backfill_wait", "prefetch_depth", "growth_ratio_decay"):
            if getattr(self, name) < 0:
                raise ValueError(f"Limits.{name} must be >= 0, got {getattr(self, name)}")
        for name in ("watermark", "prefetch_watermark", "demote_ahead", "growth_ratio_init", "growth_ratio_min"):
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
