"""Choosing each sequence's next token with its own sampling parameters.

Every row's scores first go through its processors (the penalties, the logit bias, `min_tokens`:
what changes which token is best, greedy or not); greedy rows then take the argmax, sampling rows
go through transformers' own logits warpers (temperature, top-k, top-p, min-p, in the order
`generate` applies them) and draw from the request's own generator, so a seeded request gives the
same tokens whatever else is batched with it. Rows without processors (the default) are never
copied: the argmax of the whole batch is taken at once.
"""

from __future__ import annotations

import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    SuppressTokensLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from .request import Request, SamplingParams


def processes(params: SamplingParams) -> bool:
    """Whether a row's scores change before the argmax (a greedy row without any is left alone)."""
    return (params.repetition_penalty != 1.0 or params.presence_penalty != 0.0 or params.frequency_penalty != 0.0
            or bool(params.logit_bias) or params.min_tokens > 0)


def processed(request: Request, scores: torch.Tensor) -> torch.Tensor:
    """`scores` `[1, vocab]` (float) after the request's penalties, bias and `min_tokens`."""
    params = request.params
    if params.repetition_penalty != 1.0:  # over the prompt and the output, as transformers counts it
        seen = torch.tensor([request.prompt + request.generated], device=scores.device)
        scores = RepetitionPenaltyLogitsProcessor(params.repetition_penalty)(seen, scores)
    if (params.presence_penalty or params.frequency_penalty) and request.generated:  # the output only (OpenAI)
        counts = torch.bincount(torch.tensor(request.generated, device=scores.device), minlength=scores.shape[-1])
        counts = counts[: scores.shape[-1]].to(scores.dtype)
        scores = scores - params.frequency_penalty * counts - params.presence_penalty * (counts > 0).to(scores.dtype)
    if params.logit_bias:
        tokens, biases = zip(*params.logit_bias)
        scores = scores.index_add(-1, torch.tensor(tokens, device=scores.device),
                                  torch.tensor([biases], dtype=scores.dtype, device=scores.device))
    if len(request.generated) < params.min_tokens and params.eos_token_id:
        scores = SuppressTokensLogitsProcessor(list(params.eos_token_id), scores.device)(None, scores)
    return scores


def warpers(request: Request) -> LogitsProcessorList:
    params, chain = request.params, LogitsProcessorList()
    if params.temperature != 1.0:
        chain.append(TemperatureLogitsWarper(params.temperature))
    if params.top_k:
        chain.append(TopKLogitsWarper(params.top_k))
    if params.top_p < 1.0:
        chain.append(TopPLogitsWarper(params.top_p))
    if params.min_p > 0.0:
        chain.append(MinPLogitsWarper(params.min_p))
    return chain


def logprobs_of(logits: torch.Tensor, token: int, top: int) -> tuple[float, list[tuple[int, float]]]:
    """The model's log-probability of `token` and the `top` likeliest tokens' (a row's raw scores)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    values, tokens = logprobs.topk(top) if top else (logprobs[:0], logprobs[:0])
    return float(logprobs[token]), list(zip(map(int, tokens.tolist()), values.tolist()))


def choose(request: Request, scores: torch.Tensor) -> int:
    """The argmax of a greedy row's `scores` `[1, vocab]`, a draw from a sampling row's warped ones."""
    if not request.params.do_sample:
        return int(scores.argmax(dim=-1))
    probabilities = torch.softmax(warpers(request)(None, scores), dim=-1)
    if not torch.isfinite(probabilities).all():  # a temperature so small that the scores overflow:
        return int(scores.argmax(dim=-1))  # sampling's limit as the temperature goes to 0
    return int(torch.multinomial(probabilities, 1, generator=request.generator_on(probabilities.device)))


def sample(logits: torch.Tensor, requests: list[Request]) -> list[int | Exception]:
    """One token per row of `logits` `[rows, vocab]` (row i belongs to requests[i]), or the error
    that sampling that row raised (it fails only its own request). A request that asks for
    log-probabilities gets them appended to its `logprobs`, one entry per token chosen."""
    chosen: list[int | Exception] = logits.argmax(dim=-1).tolist()
    broken = (torch.isnan(logits) | torch.isposinf(logits)).any(dim=-1).tolist()  # -inf: an impossible token
    for row, request in enumerate(requests):
        if broken[row]:  # greedy or not: the argmax of NaNs is no answer
            chosen[row] = ValueError("the model's scores for this row are NaN or +inf")
            continue
        params, constraint = request.params, request.constraint
        if not (params.do_sample or processes(params) or constraint is not None):
            continue
        try:
            scores = logits[row : row + 1].float()
            if processes(params):
                scores = processed(request, scores)
            if constraint is not None:  # the grammar's mask: after the penalties, before the choice
                scores = constraint.masked(scores)
            chosen[row] = token = choose(request, scores)
            if constraint is not None:
                constraint.accept(token)
        except Exception as error:  # noqa: BLE001 - reported to that request alone
            chosen[row] = error
    for row, request in enumerate(requests):
        if request.params.logprobs is not None and not isinstance(chosen[row], Exception):
            request.logprobs.append(logprobs_of(logits[row], chosen[row], request.params.logprobs))
    return chosen
