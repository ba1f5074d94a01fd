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


def sample(logits: torch.Tensor, requests: list[Request]) -> list[int | Exception]:
    """One token per row of `logits` `[rows, vocab]` (row i belongs to requests[i]), or the error
    that sampling that row raised (it fails only its own request)."""
    chosen: list[int | Exception] = logits.argmax(dim=-1).tolist()
    broken = (torch.isnan(logits) | torch.isposinf(logits)).any(dim=-1).tolist()  # -inf: an impossible token
    for row, request in enumerate(requests):
        if broken[row]:  # greedy or not: the argmax of NaNs is no answer
            chosen[row] = ValueError("the model's scores for this row are NaN or +inf")
            continue
        if not request.params.do_sample:
            continue
        try:
            scores = warpers(request)(None, logits[row : row + 1].float())
            probabilities = torch.softmax(scores, dim=-1)
            if not torch.isfinite(probabilities).all():  # a temperature so small that the scores overflow:
                continue  # sampling's limit as the temperature goes to 0, the argmax
            chosen[row] = int(torch.multinomial(probabilities, 1, generator=request.generator_on(probabilities.device)))
        except Exception as error:  # noqa: BLE001 - reported to that request alone
            chosen[row] = error
    return chosen
