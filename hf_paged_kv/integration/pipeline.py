"""`hf_paged_kv.pipeline`: a standard text-generation pipeline whose every generate call gets a
fresh PagedCache on the model's pool, so calls reuse each other's prefixes.

    >>> chat = hf_paged_kv.pipeline("text-generation", model=model, tokenizer=tokenizer)
    >>> chat([{"role": "user", "content": "Hi!"}], max_new_tokens=20)

transformers' pipeline forwards `past_key_values` to `generate` but would reuse one cache object
for every input; here each call of `_forward` (one generate) gets its own cache, released as
soon as the call returns.
"""

from __future__ import annotations

import transformers
from transformers.pipelines.text_generation import TextGenerationPipeline

from ..cache.paged_cache import PagedCache
from .hooks import enable


class PagedTextGenerationPipeline(TextGenerationPipeline):
    """TextGenerationPipeline with a fresh PagedCache per generate call."""

    paged_tenant = "default"

    def _forward(self, model_inputs, **generate_kwargs):
        if "past_key_values" in generate_kwargs:
            raise ValueError("hf_paged_kv.pipeline supplies its own PagedCache; do not pass past_key_values")
        with PagedCache(tenant=self.paged_tenant) as cache:
            return super()._forward(model_inputs, past_key_values=cache, **generate_kwargs)


def pipeline(task: str = "text-generation", model=None, tokenizer=None, tenant: str = "default", **kwargs):
    """Build a transformers text-generation pipeline on a paged, prefix-reusing model.

    `model` must be a model object (it is enabled with `hf_paged_kv.enable` if needed);
    `tenant` names whose prefixes the pipeline's calls share. Other arguments go to
    `transformers.pipeline`.
    """
    if task != "text-generation":
        raise ValueError(f"hf_paged_kv.pipeline supports task='text-generation' only, got {task!r}")
    if isinstance(model, str) or model is None:
        raise ValueError("pass a loaded model object: hf_paged_kv never downloads weights")
    enable(model)
    pipe = transformers.pipeline(task, model=model, tokenizer=tokenizer, pipeline_class=PagedTextGenerationPipeline,
                                 **kwargs)
    pipe.paged_tenant = tenant
    return pipe
