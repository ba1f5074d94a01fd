"""Choosing each sequence's next token with its own sampling parameters.

Greedy rows take the argmax, all at once. Sampling rows go through transformers' own logits
warpers (temperature, top-k, top-p, in the order `generate` applies them) and draw from the
request's own generator, so a seeded request gives the same tokens whatever else is batched
with it.
"""

from __future__ import annotations

import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from .request import Request


def warpers(request: Request) -> LogitsProcessorList:
    params, chain = request.params, LogitsProcessorList()
    if params.temperature != 1.0:
        chain.append(TemperatureLogitsWarper(params.temperature))
    if params.top_k:
        chain.append(TopKLogitsWarper(params.top_k))
    if params.top_p < 1.0:
        chain.append(TopPLogitsWarper(params.top_p))
    return chain


def sample(logits: torch.Tensor, requests: list[Request]) -> list[int]:
    """One token per row of `logits` `[rows, vocab]` (row i belongs to requests[i])."""
    chosen = logits.argmax(dim=-1).tolist()
    for row, request in enumerate(requests):
        if not request.params.do_sample:
            continue
        scores = warpers(request)(None, logits[row : row + 1].float())
        probabilities = torch.softmax(scores, dim=-1)
        chosen[row] = int(torch.multinomial(probabilities, 1, generator=request.generator))
    return chosen
