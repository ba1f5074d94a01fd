"""How a request's tokens reach its reader, and how its life ends.

Every end goes through `Outcomes.end`: the scheduler takes the request out of its queues and
releases its blocks (full ones stay cached), the counters and the load controller learn the
outcome, and its stream closes, whatever failed on the way, so that no reader waits forever.
"""

from __future__ import annotations

import logging
import time

from ..errors import Overloaded
from .metrics import EngineMetrics
from .request import Request, RequestFailed
from .scheduler import Scheduler

log = logging.getLogger("hf_paged_kv.engine")


class Outcomes:
    def __init__(self, scheduler: Scheduler, metrics: EngineMetrics, load):
        self.scheduler, self.metrics, self.load = scheduler, metrics, load

    def emit(self, request: Request, token: int, now: float) -> None:
        """Stream a sampled token; the request ends at its EOS or its max_new_tokens."""
        if request.cancel_requested:  # asked during this forward: it ends now, not at a later intake
            self.end(request, request.cancel_requested)
            return
        request.generated.append(token)
        request.stream.push(token)
        self.metrics.token(request, now)
        if request.first_token is None:
            request.first_token = now
            self.load.signals.record("ttft", now - request.arrived, now)
        request.last_token = now
        if token in request.params.eos_token_id or len(request.generated) >= request.params.max_new_tokens:
            self.end(request, "finished")

    def end(self, request: Request, outcome: str, error: BaseException | None = None) -> None:
        """Release the request's blocks (full ones stay cached) and close its stream."""
        try:
            self.scheduler.finish(request, outcome)
            request.finished = time.monotonic()
            self.metrics.ended(request, outcome)
            if outcome == "finished":
                self.load.finished(request)
        finally:  # whatever failed above, it has ended and its reader must not wait forever
            request.outcome = request.outcome or outcome
            request.stream.close(error)

    def end_all(self, outcome: str, reason: str | None = None) -> None:
        """End every waiting and running request (failed for `reason`, if given); one that fails
        to end keeps no other open."""
        for request in self.scheduler.waiting + self.scheduler.running:
            try:
                self.end(request, outcome, reason and RequestFailed(reason))
            except Exception:  # noqa: BLE001 - its stream is closed (see end); the others must end too
                log.exception("ending request %d failed", request.id)

    def cannot_fit(self, request: Request, reason: str) -> None:
        """A request the pool can never hold (pins may leave it less than its size): failed, or
        if it has streamed tokens, finished with them – the pool is its length limit, as the
        context is – instead of losing them."""
        if request.generated:
            log.warning("%s; it ends with the %d tokens it has", reason, len(request.generated))
            self.end(request, "finished")
        else:
            self.end(request, "failed", RequestFailed(reason))

    def turn_away(self, request: Request) -> None:
        """Refuse a waiting request while overloaded: its stream ends with `Overloaded`."""
        load = self.load
        load.signals.record("rejection")
        ahead = load.staying_ahead(request.effective_priority, besides=request)
        self.end(request, "rejected", Overloaded(load.retry_after(ahead, besides=request),
                                                  "overloaded: this priority is shed for now"))
