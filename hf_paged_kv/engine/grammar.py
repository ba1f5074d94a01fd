"""Structured output: a request's tokens held to a JSON schema (or to any JSON value) while they
are sampled, with xgrammar.

Each step a constrained row's scores are masked to the tokens that keep the text a prefix of a
document the grammar accepts (after the penalties and the bias, before the argmax or the
warpers); the token chosen then advances the row's matcher. Once the document is complete the
grammar allows only the request's end tokens, so the request ends there. xgrammar was chosen over
llguidance by `bench/bench_grammar.py`: 5-7 us per token for a mask on SmolLM2's vocabulary on this
CPU, against 20-58 us (docs/benchmarks.md); its compiler caches compiled grammars.

    engine.submit("A JSON order:", json_schema={"type": "object", ...})   # or json_schema=True: any JSON
"""

from __future__ import annotations

import json
import threading

import torch

try:
    import xgrammar
except ImportError:  # the `serve` extra installs it; a request with a schema says so
    xgrammar = None


class GrammarError(ValueError):
    """A schema the grammar engine cannot compile, or structured output this engine cannot give."""


class Grammars:
    """An engine's grammar compiler (its tokenizer, the model's vocabulary); thread-safe."""

    def __init__(self, tokenizer, vocab_size: int):
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self.compiler = None
        self.lock = threading.Lock()

    def compile(self, schema: dict | str | bool, strict: bool = True):
        """The compiled grammar of `schema` (a JSON schema, as a dict or JSON text; True: any JSON
        value), compact JSON (no free whitespace: a model that keeps emitting spaces could
        otherwise never end). Raises `GrammarError` naming the problem."""
        if xgrammar is None:
            raise GrammarError("structured output needs xgrammar: pip install 'hf_paged_kv[serve]'")
        if self.tokenizer is None:
            raise GrammarError("structured output needs the engine's tokenizer (Engine(..., tokenizer=...))")
        with self.lock:
            if self.compiler is None:
                info = xgrammar.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size)
                self.compiler = xgrammar.GrammarCompiler(info)
            try:
                if schema is True:
                    return self.compiler.compile_builtin_json_grammar()
                text = schema if isinstance(schema, str) else json.dumps(schema)
                return self.compiler.compile_json_schema(text, any_whitespace=False, separators=(",", ":"),
                                                         strict_mode=strict)
            except Exception as error:  # noqa: BLE001 - xgrammar raises several kinds for a bad schema
                raise GrammarError(f"the JSON schema cannot be compiled: {error}") from None


class Constraint:
    """One request's matcher: the mask of its next token, and the tokens it accepts."""

    def __init__(self, compiled, end_tokens: tuple[int, ...], vocab_size: int):
        if not end_tokens:
            raise GrammarError("structured output needs an end token (the document ends there): "
                               "ignore_eos or an empty eos_token_id cannot go with a json_schema")
        self.matcher = xgrammar.GrammarMatcher(compiled, override_stop_tokens=list(end_tokens))
        self.mask = xgrammar.allocate_token_bitmask(1, vocab_size)
        self.vocab_size = vocab_size

    def masked(self, scores: torch.Tensor) -> torch.Tensor:
        """`scores` `[1, vocab]` (float, a copy of the row's) with every token the grammar does
        not allow next at -inf."""
        self.matcher.fill_next_token_bitmask(self.mask)
        scores = scores.clone()
        xgrammar.apply_token_bitmask_inplace(scores, self.mask.to(scores.device), vocab_size=self.vocab_size)
        return scores

    def accept(self, token: int) -> None:
        if not self.matcher.accept_token(token):
            raise GrammarError(f"the grammar refused token {token}, which its own mask allowed")
