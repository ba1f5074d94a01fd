"""The README names every statistic a user can read: `KVPool.stats()` (with both tiers),
`Engine.stats()` and its controller's settings."""

from __future__ import annotations

import re
from pathlib import Path

from conftest import make_model

import hf_paged_kv
from hf_paged_kv import Engine, KVPool

README = (Path(__file__).resolve().parent.parent / "README.md").read_text()


def unnamed(keys) -> list[str]:
    return sorted(k for k in keys if not re.search(rf"\b{re.escape(k)}\b", README))


def test_every_statistic_is_named_in_the_readme(tmp_path):
    model = make_model("llama", seed=1)
    pool = hf_paged_kv.enable(model, pool=KVPool(num_blocks=32, block_size=8, host_blocks=8, disk_dir=tmp_path))
    engine = Engine(model, pool=pool)
    with engine:
        engine.submit([5, 6, 7], max_new_tokens=2, eos_token_id=[]).result(timeout=60)
    stats = engine.stats()
    assert unnamed(pool.stats()) == []
    assert unnamed(stats) == []
    assert unnamed(stats["controller"]) == []
    hf_paged_kv.disable(model)
