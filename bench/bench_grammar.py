"""The per-token cost of constrained decoding on this CPU: xgrammar against llguidance, on
SmolLM2's tokenizer (49,152 tokens), for JSON mode and a JSON schema.

    python bench/bench_grammar.py            # 5 repeats; writes its section of docs/benchmarks.md
    python bench/bench_grammar.py --smoke    # 1 repeat, prints only

Each engine compiles the grammar, then a valid document's tokens are fed one at a time: per token
the allowed-token mask is computed (what a decoding step waits for) and the token accepted. The
documents are the same for both engines, tokenized once; both must accept every token and end in
an accepting state (checked). Times are medians over repeats, the engines alternating.
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import common
from common import Checks, arguments, markdown_table, note

SCHEMA = {  # an order in a shop: nested objects, arrays, enums, numbers, strings
    "type": "object",
    "properties": {
        "id": {"type": "integer"},
        "customer": {"type": "object", "properties": {"name": {"type": "string"}, "email": {"type": "string"}},
                     "required": ["name", "email"]},
        "items": {"type": "array", "items": {
            "type": "object", "properties": {"sku": {"type": "string"}, "quantity": {"type": "integer"},
                                             "price": {"type": "number"}},
            "required": ["sku", "quantity", "price"]}},
        "status": {"enum": ["new", "paid", "shipped"]},
        "gift": {"type": "boolean"},
    },
    "required": ["id", "customer", "items", "status", "gift"],
}
DOCUMENT = {"id": 4711, "customer": {"name": "Ada Lovelace", "email": "ada@example.org"},
            "items": [{"sku": "CROISSANT-01", "quantity": 6, "price": 1.2},
                      {"sku": "BREAD-RYE", "quantity": 1, "price": 3.75}],
            "status": "paid", "gift": False}


class XGrammar:
    name = "xgrammar"

    def __init__(self, tokenizer, vocab: int, eos: int):
        import xgrammar

        self.xgr, self.vocab = xgrammar, vocab
        self.compiler = xgrammar.GrammarCompiler(xgrammar.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab, stop_token_ids=[eos]), cache_enabled=False)

    def compile(self, schema):
        return self.compiler.compile_builtin_json_grammar() if schema is None else \
            self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, separators=(",", ":"))

    def run(self, compiled, tokens, eos):
        matcher, mask = self.xgr.GrammarMatcher(compiled), self.xgr.allocate_token_bitmask(1, self.vocab)
        masks = 0.0
        for token in tokens:
            started = time.perf_counter()
            matcher.fill_next_token_bitmask(mask)
            masks += time.perf_counter() - started
            if not matcher.accept_token(token):
                return None
        return masks, matcher.accept_token(eos) and matcher.is_terminated()


class LLGuidance:
    name = "llguidance"

    def __init__(self, tokenizer, vocab: int, eos: int):
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self.ll, self.vocab = llguidance, vocab
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab, eos_token=eos)

    def compile(self, schema):
        grammar = self.ll.LLMatcher.grammar_from_json_schema(
            {"type": "object"} if schema is None else schema, defaults={"whitespace_flexible": False})
        return None if self.ll.LLMatcher.validate_grammar(grammar, self.tokenizer) else grammar

    def run(self, compiled, tokens, eos):
        if compiled is None:
            return None
        matcher = self.ll.LLMatcher(self.tokenizer, compiled)
        mask = self.ll.torch.allocate_token_bitmask(1, self.vocab)
        masks = 0.0
        for token in tokens:
            started = time.perf_counter()
            self.ll.torch.fill_next_token_bitmask(matcher, mask, 0)
            masks += time.perf_counter() - started
            if not matcher.consume_token(token):
                return None
        return masks, matcher.consume_token(eos) and matcher.is_stopped() and not matcher.is_error()


def main() -> int:
    parser = arguments(__doc__.split("\n\n")[0], repeats=5)
    args = parser.parse_args()
    common.check_repeats(args)
    from transformers import AutoTokenizer

    from hf_paged_kv.serve import smollm2_directory

    tokenizer = AutoTokenizer.from_pretrained(smollm2_directory())
    vocab, eos = len(tokenizer), tokenizer.eos_token_id
    text = json.dumps(DOCUMENT, separators=(",", ":"))
    tokens = tokenizer.encode(text, add_special_tokens=False)
    cases = {"JSON mode": None, "JSON schema (an order)": SCHEMA}
    checks, rows = Checks(), []
    engines = [XGrammar(tokenizer, vocab, eos), LLGuidance(tokenizer, vocab, eos)]
    for case, schema in cases.items():
        timings = {e.name: {"compile": [], "mask": []} for e in engines}
        for repeat in range(args.repeats):
            for engine in engines if repeat % 2 == 0 else engines[::-1]:
                started = time.perf_counter()
                compiled = engine.compile(schema)
                timings[engine.name]["compile"].append(time.perf_counter() - started)
                result = engine.run(compiled, tokens, eos)
                checks.expect(result is not None and result[1], f"{engine.name} refused the document ({case})")
                if result is not None:
                    timings[engine.name]["mask"].append(result[0] / len(tokens))
        for engine in engines:
            t = timings[engine.name]
            rows.append([case, engine.name, f"{1e3 * statistics.median(t['compile']):.1f}",
                         f"{1e6 * statistics.median(t['mask']):.0f}" if t["mask"] else "-"])
        note(f"{case}: done")
    body = "\n".join([
        "### Constrained decoding: the grammar engines' cost per token (CPU)", "",
        f"SmolLM2's tokenizer ({vocab:,} tokens); a {len(tokens)}-token JSON document fed token by token: per "
        "token the allowed-token mask is computed, then the token accepted. Both engines accept every token "
        "and end accepting.", "",
        markdown_table(["grammar", "engine", "compile ms", "mask µs/token"], rows), ""])
    return checks.finish("bench_grammar", body, args.smoke, after="bench_decode")


if __name__ == "__main__":
    sys.exit(main())
