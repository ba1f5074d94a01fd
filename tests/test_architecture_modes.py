"""Every generation mode on every supported architecture (`tiny_models.SUPPORTED`), each with
left padding, right padding and a mask with holes: PagedCache gives exactly what the default
cache gives. `test_generation_modes.py` goes deeper (attention weights, logits_to_keep,
deepcopy) on six representative architectures; this module goes wide."""

from __future__ import annotations

import pytest
import torch
from test_generation_modes import MASKS, MODES, NEW, compare, masked_batch, same_tokens
from tiny_models import CATALOGUE, SUPPORTED, VOCAB, build

WIDE_MODES = sorted(MODES) + ["inputs_embeds", "scores", "assisted", "prompt_lookup", "one_row"]


pytestmark = pytest.mark.usefixtures("one_thread")


def batch_for(kind: str):
    ids, mask = masked_batch(kind)
    return ids.clamp(max=VOCAB - 1), mask


@pytest.mark.parametrize("mask_kind", MASKS)
@pytest.mark.parametrize("mode", WIDE_MODES)
@pytest.mark.parametrize("arch", SUPPORTED)
def test_mode_on_architecture(arch, mode, mask_kind):
    if mask_kind == "right" and CATALOGUE[arch].reference == "eager":
        pytest.xfail("a query that sees no key: eager averages the masked keys, hf_paged_kv gives zeros as sdpa")
    model = build(arch)
    ids, mask = batch_for(mask_kind)
    if mode == "one_row":  # every pad column is a pad in the whole batch: the forward may drop it
        row = 1 if mask_kind == "holes" else 2
        compare(model, same_tokens, input_ids=ids[row : row + 1], attention_mask=mask[row : row + 1],
                max_new_tokens=NEW, do_sample=False)
    elif mode in ("assisted", "prompt_lookup"):  # batch 1, as transformers requires
        row = 1 if mask_kind == "holes" else 2
        ids, mask = ids[row : row + 1], mask[row : row + 1]
        extra = dict(assistant_model=build(arch, seed=11)) if mode == "assisted" else dict(prompt_lookup_num_tokens=3)
        compare(model, same_tokens, input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False, **extra)
    elif mode == "inputs_embeds":
        compare(model, same_tokens, inputs_embeds=model.get_input_embeddings()(ids), attention_mask=mask,
                max_new_tokens=NEW, do_sample=False)
    elif mode == "scores":
        def check(got, expected):
            same_tokens(got, expected)
            for a, b in zip(got.scores, expected.scores):
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)

        compare(model, check, input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False,
                return_dict_in_generate=True, output_scores=True)
    else:
        options = dict(MODES[mode])
        options.setdefault("max_new_tokens", NEW)
        compare(model, same_tokens, input_ids=ids, attention_mask=mask, **options)
