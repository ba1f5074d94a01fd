"""The model fingerprint that namespaces every cached block: whatever way the weights change
after `enable` (tensors assigned or replaced, a few rows edited in place, a conversation that
goes on across the change, a restart on other weights), KV of the old weights is never served,
and generate gives exactly DynamicCache's tokens."""

from __future__ import annotations

import pytest
import torch
from conftest import VOCAB, assert_pool_clean, greedy, make_model
from transformers import DynamicCache

import hf_paged_kv
from hf_paged_kv import KVPool, PagedCache, PagedKVError
from hf_paged_kv.integration.fingerprint import sample

pytestmark = pytest.mark.usefixtures("one_thread")
BLOCK = 8


def prompt(n, seed, low=3):
    return torch.randint(low, VOCAB, (1, n), generator=torch.Generator().manual_seed(seed))


def generate(model, ids, cache, new=8):
    return greedy(model, cache, ids, torch.ones_like(ids), new_tokens=new)


def paged(model, ids):
    """Tokens of a fresh request and how many prompt tokens it inherited."""
    with PagedCache() as cache:
        out = generate(model, ids, cache)
        return out, cache.inherited[0]


def reference(model, ids):
    """DynamicCache's tokens: the model's own attention, on the weights it has now."""
    hf_paged_kv.disable(model)
    return generate(model, ids, DynamicCache())


def cached_then_changed(change, ids=None):
    """An enabled model whose prompt is cached, then `change(model)` applied to it."""
    model, ids = make_model("llama", seed=1), prompt(40, 3) if ids is None else ids
    pool = hf_paged_kv.enable(model, pool=KVPool(num_blocks=64, block_size=BLOCK))
    assert paged(model, ids)[1] == 0
    assert paged(model, ids)[1] == 32  # cached for the weights it has now
    with torch.no_grad():
        change(model)
    return model, ids, pool


# ------------------------------------------------------------- the changes
def assign_other_weights(model):
    """New tensors, not new values: `enable` saw other objects."""
    model.load_state_dict(make_model("llama", seed=2).state_dict(), assign=True)


def replace_key_value_projections(model):
    """What adapter injection does: other modules where the old ones were."""
    other = make_model("llama", seed=6)
    for layer, donor in zip(model.model.layers, other.model.layers):
        layer.self_attn.k_proj, layer.self_attn.v_proj = donor.self_attn.k_proj, donor.self_attn.v_proj


def edit_late_embedding_rows(model):
    """A fine-tune of some token embeddings: the first rows stay as they were."""
    rows = model.model.embed_tokens.weight[48:]
    rows += 0.5 * torch.randn(rows.shape, generator=torch.Generator().manual_seed(4))


def negate_key_rows_after_the_first(model):
    """Other keys and values, with each weight's first row (its first elements) unchanged."""
    for layer in model.model.layers:
        layer.self_attn.k_proj.weight[1:] *= -1.0
        layer.self_attn.v_proj.weight[1:] *= 0.5


def edit_one_unsampled_weight(model):
    """One element changed in place, where the fingerprint's strided sample does not look: only
    the weight's version counter tells."""
    weight = model.model.layers[0].self_attn.k_proj.weight
    before = sample(weight).clone()
    weight.view(-1)[1] += 3.0
    assert torch.equal(sample(weight), before)


@pytest.mark.parametrize("change", [assign_other_weights, replace_key_value_projections, edit_late_embedding_rows,
                                    negate_key_rows_after_the_first, edit_one_unsampled_weight])
def test_changed_weights_never_inherit_the_old_kv(change):
    ids = prompt(40, 3, low=48 if change is edit_late_embedding_rows else 3)  # tokens of the edited rows
    model, ids, pool = cached_then_changed(change, ids=ids)
    got, inherited = paged(model, ids)
    assert inherited == 0
    assert paged(model, ids)[1] == 32  # the new weights' KV is reused as usual
    assert_pool_clean(pool)
    torch.testing.assert_close(got, reference(model, ids), rtol=0, atol=0)


def test_a_weight_swapped_in_beside_one_edited_in_place_changes_the_fingerprint():
    """Once a weight is edited in place the fingerprint carries a token, kept while no version
    changes; a tensor swapped in meanwhile (its version its own) must still change it when the
    sample cannot tell it from its predecessor."""
    model, ids, pool = cached_then_changed(edit_one_unsampled_weight)
    assert paged(model, ids)[1] == 0
    assert paged(model, ids)[1] == 32  # cached for the edited weights
    other = model.model.layers[1].self_attn.k_proj
    swapped = other.weight.detach().clone()
    swapped.view(-1)[1] -= 3.0  # where the sample does not look
    other.weight = torch.nn.Parameter(swapped)
    got, inherited = paged(model, ids)
    assert inherited == 0
    torch.testing.assert_close(got, reference(model, ids), rtol=0, atol=0)
    assert_pool_clean(pool)


def edit_unsampled_key_weights(model):
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.k_proj.weight.view(-1)[1] += 25.0


def test_an_edit_then_the_weights_rewrapped_before_the_next_turn_is_seen():
    """`load_state_dict(model.state_dict(), assign=True)` wraps the same storage (and version
    counter) in new tensors: an edit just before it still counts."""
    model, ids, pool = cached_then_changed(lambda m: None)
    edit_unsampled_key_weights(model)
    model.load_state_dict(model.state_dict(), assign=True)
    got, inherited = paged(model, ids)
    assert inherited == 0
    torch.testing.assert_close(got, reference(model, ids), rtol=0, atol=0)
    assert_pool_clean(pool)


@pytest.mark.filterwarnings("ignore:hf_paged_kv disk tier")
def test_edited_weights_never_take_the_unedited_fingerprint_back(tmp_path):
    """Once edited, the weights keep a token of their own: swapped into new tensors with the
    same values, or re-enabled on a new pool, the sample alone would give the unedited weights'
    fingerprint, and their disk files."""
    system, model = prompt(40, 7), make_model("llama", seed=61)
    hf_paged_kv.enable(model, pool=KVPool(num_blocks=24, block_size=BLOCK, disk_dir=tmp_path))
    hf_paged_kv.persist(model, system[0])  # the unedited weights' files
    edit_unsampled_key_weights(model)
    ids = torch.cat([system, prompt(6, 8)], 1)
    assert paged(model, ids)[1] == 0
    model.load_state_dict({k: v.clone() for k, v in model.state_dict().items()}, assign=True)  # other storage
    assert paged(model, ids)[1] == 0
    hf_paged_kv.disable(model)
    pool = hf_paged_kv.enable(model, pool=KVPool(num_blocks=24, block_size=BLOCK, disk_dir=tmp_path))
    assert pool.stats()["disk_blocks"] == 0
    got, inherited = paged(model, ids)
    assert inherited == 0
    torch.testing.assert_close(got, reference(model, ids), rtol=0, atol=0)


@pytest.mark.filterwarnings("ignore:hf_paged_kv disk tier")
def test_a_loop_editing_weights_between_generate_calls_leaves_no_files_behind(tmp_path):
    """Files of weights edited in place serve no other process: deleted when the weights change
    again, not set aside (a training loop would fill the directory, and each change would read
    them all)."""
    model = make_model("llama", seed=61)
    pool = hf_paged_kv.enable(model, pool=KVPool(num_blocks=24, block_size=BLOCK, disk_dir=tmp_path))
    ids = prompt(30, 7)
    hf_paged_kv.persist(model, ids[0])  # 3 files of the unedited weights
    for step in range(5):
        edit_unsampled_key_weights(model)
        hf_paged_kv.persist(model, ids[0])
        assert pool.stats()["disk_blocks"] == 3  # this step's, the step before's deleted
    assert len(list(tmp_path.glob("*.kvblock"))) == 6  # and the unedited weights', set aside
    hf_paged_kv.disable(model)


def test_equal_weights_assigned_keep_the_cached_kv():
    """The fingerprint is of the values, not of the tensor objects: reloading the same weights
    (or restarting the process) keeps what they computed."""
    model, ids, _ = cached_then_changed(lambda m: m.load_state_dict(make_model("llama", seed=1).state_dict(), assign=True))
    got, inherited = paged(model, ids)
    assert inherited == 32
    torch.testing.assert_close(got, reference(model, ids), rtol=0, atol=0)


def test_weights_made_under_inference_mode_have_no_version_to_watch_and_are_served():
    with torch.inference_mode():
        model = make_model("llama", seed=1)
    ids = prompt(20, 3)
    expected = generate(model, ids, DynamicCache())
    hf_paged_kv.enable(model, pool=KVPool(num_blocks=32, block_size=4))
    assert paged(model, ids)[1] == 0
    got, inherited = paged(model, ids)
    assert inherited == 16
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    hf_paged_kv.disable(model)


def test_weights_assigned_in_another_dtype_are_refused():
    model, ids, _ = cached_then_changed(
        lambda m: m.load_state_dict({k: v.to(torch.bfloat16) for k, v in m.state_dict().items()}, assign=True))
    with pytest.raises(PagedKVError, match="dtype or device changed after hf_paged_kv.enable"):
        paged(model, ids)
    hf_paged_kv.disable(model)


# ------------------------------------------------------------ conversations
def merge_adapter(model):
    """An in-place update of every key projection, as merging a LoRA adapter does."""
    for layer in model.model.layers:
        weight = layer.self_attn.k_proj.weight
        weight.add_(0.3 * torch.randn(weight.shape, generator=torch.Generator().manual_seed(5)))


def chat(model, cache, turn1, turn2):
    """Two turns in one cache, the adapter merged between them; returns the second turn's output."""
    out = generate(model, turn1, cache, new=4)
    with torch.no_grad():
        merge_adapter(model)
    return generate(model, torch.cat([out, turn2], 1), cache, new=4)


def test_a_conversation_continued_on_changed_weights_shares_nothing():
    """The second turn extends KV of the old weights with the new ones: like DynamicCache, but
    such KV matches neither weights, so no later request may inherit it."""
    model = make_model("llama", seed=1)
    original = {name: weight.clone() for name, weight in model.state_dict().items()}
    turn1, turn2 = prompt(20, 3), prompt(20, 4)
    pool = hf_paged_kv.enable(model, pool=KVPool(num_blocks=64, block_size=4, hot_threshold=None))
    with PagedCache() as cache:
        got = chat(model, cache, turn1, turn2)
    model.load_state_dict(original)  # unmerge: the first weights again
    question = torch.cat([got, prompt(3, 6)], 1)
    answer, inherited = paged(model, question)
    assert inherited == 0
    assert_pool_clean(pool)
    torch.testing.assert_close(answer, reference(model, question), rtol=0, atol=0)
    model.load_state_dict(original)
    torch.testing.assert_close(got, chat(model, DynamicCache(), turn1, turn2), rtol=0, atol=0)


# ---------------------------------------------------------------- restarts
@pytest.mark.filterwarnings("ignore:hf_paged_kv disk tier")  # it names the files of other weights it ignores
def test_disk_kv_of_other_weights_is_not_loaded_after_a_restart(tmp_path):
    system = prompt(40, 7)
    first = make_model("llama", seed=61)
    hf_paged_kv.enable(first, pool=KVPool(num_blocks=24, block_size=BLOCK, disk_dir=tmp_path))
    hf_paged_kv.persist(first, system[0])
    hf_paged_kv.disable(first)
    second = make_model("llama", seed=61)  # a new checkpoint of the same config
    with torch.no_grad():
        negate_key_rows_after_the_first(second)
    pool = hf_paged_kv.enable(second, pool=KVPool(num_blocks=24, block_size=BLOCK, disk_dir=tmp_path))
    assert pool.stats()["disk_blocks"] == 0
    ids = torch.cat([system, prompt(6, 8)], 1)
    got, inherited = paged(second, ids)
    assert inherited == 0
    torch.testing.assert_close(got, reference(second, ids), rtol=0, atol=0)


@pytest.mark.filterwarnings("ignore:hf_paged_kv disk tier")
def test_weights_changed_in_place_keep_the_old_weights_disk_files_for_a_restart(tmp_path):
    """The old weights' files are set aside (never served to the new weights), not deleted: a
    restart, or another process sharing the directory, on the old weights still reuses them."""
    system = prompt(40, 7)
    model = make_model("llama", seed=61)
    hf_paged_kv.enable(model, pool=KVPool(num_blocks=24, block_size=BLOCK, disk_dir=tmp_path))
    hf_paged_kv.persist(model, system[0])
    with torch.no_grad():
        merge_adapter(model)
    ids = torch.cat([system, prompt(6, 8)], 1)
    got, inherited = paged(model, ids)  # its first forward takes the fingerprint: the weights changed
    assert inherited == 0
    assert hf_paged_kv.pool_of(model).stats()["disk_blocks"] == 0
    torch.testing.assert_close(got, reference(model, ids), rtol=0, atol=0)
    restarted = make_model("llama", seed=61)
    pool = hf_paged_kv.enable(restarted, pool=KVPool(num_blocks=24, block_size=BLOCK, disk_dir=tmp_path))
    assert pool.stats()["disk_blocks"] == 5
    got, inherited = paged(restarted, ids)
    assert inherited == 40
    torch.testing.assert_close(got, reference(restarted, ids), rtol=0, atol=0)


@pytest.mark.filterwarnings("ignore:hf_paged_kv disk tier")
def test_weights_that_come_back_are_served_their_disk_files_again(tmp_path):
    system = prompt(40, 7)
    model = make_model("llama", seed=61)
    pool = hf_paged_kv.enable(model, pool=KVPool(num_blocks=24, block_size=BLOCK, disk_dir=tmp_path))
    hf_paged_kv.persist(model, system[0])
    ids = torch.cat([system, prompt(6, 8)], 1)
    assign_other_weights(model)
    assert paged(model, ids)[1] == 0  # other weights: the files are set aside
    model.load_state_dict(make_model("llama", seed=61).state_dict(), assign=True)  # the first weights again
    got, inherited = paged(model, ids)
    assert inherited == 40
    assert pool.stats()["disk_hits"] == 5
    torch.testing.assert_close(got, reference(model, ids), rtol=0, atol=0)


# ------------------------------------------------------------------- its cost
def count_weight_reads(model) -> list:
    """Count the full passes over `model.named_parameters()` (one per fingerprint taken); the
    dtype check's single lookup does not count."""
    passes, named_parameters = [], model.named_parameters

    def counting(*args, **kwargs):
        yield from named_parameters(*args, **kwargs)
        passes.append(1)

    model.named_parameters = counting
    return passes


def test_assisted_decoding_takes_the_fingerprint_once_per_call():
    """Verification forwards feed several tokens each; within one `generate` call the weights do
    not change, so only its first forward reads them. A direct multi-token forward still does."""
    model, assistant = make_model("llama", seed=10), make_model("llama", seed=11)
    ids = prompt(30, 12)
    expected = model.generate(input_ids=ids, past_key_values=DynamicCache(), max_new_tokens=20, do_sample=False)
    hf_paged_kv.enable(model, pool=KVPool(num_blocks=64, block_size=4))
    passes = count_weight_reads(model)
    with PagedCache() as cache:
        got = model.generate(input_ids=ids, past_key_values=cache, assistant_model=assistant, max_new_tokens=20,
                             do_sample=False)
        assert len(passes) == 1
        model(input_ids=got[:, -1:], past_key_values=cache)  # a decode step outside generate: no read
        assert len(passes) == 1
        model(input_ids=prompt(3, 13), past_key_values=cache)  # a new turn outside generate: a read
        assert len(passes) == 2
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    hf_paged_kv.disable(model)
    assert "generate" not in vars(model) and "forward" not in vars(model)


def test_forwards_of_another_model_inside_a_generate_call_are_checked_as_outside_one():
    """Only the forwards of the model and cache the call was given are one turn; another
    enabled model's multi-token forwards run from a logits processor each check the weights."""
    model, other = make_model("llama", seed=10), make_model("llama", seed=11)
    pool = hf_paged_kv.enable(model, pool=KVPool(num_blocks=64, block_size=4))
    hf_paged_kv.enable(other, pool=pool)
    passes = count_weight_reads(other)

    side = PagedCache()

    def side_forward(input_ids, scores):  # a turn of another conversation at each step
        other(input_ids=prompt(3, len(passes)), past_key_values=side)
        return scores

    with PagedCache() as cache:
        model.generate(input_ids=prompt(10, 1), past_key_values=cache, max_new_tokens=4, do_sample=False,
                       logits_processor=[side_forward])
    side.release()
    assert len(passes) == 4
