"""In-process checks of the tokenizer, chat template, KV model, block pool and reference."""

from __future__ import annotations

import string

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvrelay.enginesim.chat import ChatTemplateError, render_chat
from kvrelay.enginesim.config import EngineConfig
from kvrelay.enginesim.engine import EngineCore, run_to_completion
from kvrelay.enginesim.kvpool import BlockPool, BlockPoolError, KVLayout
from kvrelay.enginesim.model import ModelGeometry, SimModel
from kvrelay.enginesim.reference import reference_chat, reference_completion
from kvrelay.enginesim.request import Output, SamplingParams, SimRequest
from kvrelay.enginesim.tokenizer import Tokenizer, get_tokenizer

TOK = get_tokenizer()


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=200))
def test_text_round_trips_through_encode_decode(text: str) -> None:
    assert TOK.decode(TOK.encode(text, parse_special=False)) == text


def test_a_long_text_encoded_again_gives_its_own_copy_of_the_same_ids() -> None:
    text = "".join(f" word{i % 97} and, more: {i}!" for i in range(400))
    first = TOK.encode(text)
    first.append(-1)  # the caller's list is its own: the kept encoding is not changed
    again = TOK.encode(text)
    assert again == first[:-1] and again is not first
    assert TOK.decode(again) == text


_WORDS = ["a", " the", "\n", " ", "  ", "'s", "x1", "é", "...", "\t", " word"]
_SPECIALS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|im_", "start|>"]
_PIECES = st.sampled_from(_WORDS + _SPECIALS)


@settings(max_examples=200, deadline=None)
@given(st.lists(_PIECES, min_size=300, max_size=700), st.lists(_PIECES, max_size=60))
def test_a_text_extending_a_known_one_encodes_as_if_new(head: list[str], tail: list[str]) -> None:
    # The tokenizer reuses the ids of a text it encoded that this one starts with (up to its
    # last special token, "<|im_" "start|>" pieces making one only when joined): the same ids
    # as a tokenizer that never saw it.
    first, extended = "".join(head), "".join(head + tail)
    tok = Tokenizer()
    tok.encode(first)
    assert tok.encode(extended) == Tokenizer().encode(extended)
    assert tok.encode(extended + first) == Tokenizer().encode(extended + first)


def test_generated_tokens_can_retokenize_differently() -> None:
    # The model may emit byte tokens "t", "h" side by side; their text encodes as one "th".
    t, h = TOK.encode("t")[0], TOK.encode("h")[0]
    assert TOK.encode(TOK.decode([t, h])) != [t, h]
    assert {t, h} <= set(TOK.output_vocab())
    # And real model output does hit this: some reference reply does not round-trip.
    changed = 0
    for i in range(5):
        text = reference_completion(f"prompt number {i}", 40, ignore_eos=True)
        ids = TOK.encode(text)
        changed += TOK.decode(ids) == text and len(ids) != 40
    assert changed > 0


def test_special_tokens_and_chat_template() -> None:
    text = render_chat([{"role": "user", "content": "hi"}])
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    ids = TOK.encode(text)
    assert ids[0] == TOK.special_ids["<|im_start|>"]
    assert TOK.eos_id in ids
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    assert "ab" in render_chat([{"role": "user", "content": parts}])
    with pytest.raises(ChatTemplateError):
        render_chat([{"role": "wizard", "content": "x"}])
    with pytest.raises(ChatTemplateError):
        render_chat([])


def test_kv_depends_on_the_whole_prefix() -> None:
    model = SimModel("m", ModelGeometry(), TOK.output_vocab(), TOK.eos_id)
    a = model.kv_for(model.prefix_hashes([1, 2, 3, 4, 5], 0, None))
    b = model.kv_for(model.prefix_hashes([9, 2, 3, 4, 5], 0, None))
    # Every position after the changed first token differs, not only the first.
    for pos in range(5):
        assert not np.array_equal(a[pos], b[pos])
    # Continuing a chain from a stored hash gives the same values as hashing from the start.
    hs = model.prefix_hashes([1, 2, 3, 4, 5], 0, None)
    assert model.prefix_hashes([1, 2, 3, 4, 5], 2, hs[1]) == hs[2:]
    # A position's KV depends on its hash alone: computed for a step's requests together, each
    # row is what computing it alone gives (the engine batches a step's next tokens).
    for pos, h in enumerate(hs):
        assert np.array_equal(model.kv_for([h])[0], a[pos])


@pytest.mark.parametrize("layout", list(KVLayout))
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_pool_reads_back_what_it_wrote(layout: KVLayout, dtype: str) -> None:
    geometry = ModelGeometry(num_layers=3, num_kv_heads=2, head_size=8, dtype=dtype)
    pool = BlockPool(8, 4, geometry, layout)
    blocks = pool.allocate(3)
    assert blocks is not None and pool.num_free == 5
    kv = np.random.default_rng(0).integers(-30000, 30000, (10, 3, 2, 2, 8))
    kv = kv.astype(geometry.storage_dtype)
    pool.write(blocks, 0, kv)
    assert np.array_equal(pool.read(blocks, 0, 10), kv)
    assert np.array_equal(pool.read(blocks, 3, 7), kv[3:7])
    # One position at a time (a decode step's write) and windows within one block or across
    # two (a decode step's read) agree with the bulk paths.
    single = pool.allocate(3)
    assert single is not None
    for pos in range(10):
        pool.write(single, pos, kv[pos : pos + 1])
    assert np.array_equal(pool.read(single, 0, 10), kv)
    for start in range(10):
        for end in range(start + 1, min(start + 5, 10) + 1):
            assert np.array_equal(pool.read(single, start, end), kv[start:end]), (start, end)
    pool.free(single)
    # The registered torch tensors hold exactly these bits (NIXL moves those bytes).
    cache = next(iter(pool.caches.values()))
    assert cache.dtype == geometry.torch_dtype and cache.view(torch.uint8).any()
    assert pool.allocate(6) is None and pool.num_free == 5  # all or nothing
    pool.free(blocks)
    with pytest.raises(BlockPoolError):
        pool.free(blocks[:1])


def test_output_does_not_depend_on_layout_or_block_size() -> None:
    prompt = "The same prompt on differently shaped pools"
    expected = reference_completion(prompt, 30)
    for layout in KVLayout:
        for block_size in (4, 16):
            config = EngineConfig(block_size=block_size, kv_layout=layout)
            assert reference_completion(prompt, 30, config) == expected


def _run_with_corruption(corrupt: bool) -> str:
    """Prefill a request, optionally corrupt one of its prompt blocks, then decode."""
    core = EngineCore(EngineConfig(block_size=4))
    outputs: list[Output] = []
    req = SimRequest(
        "r", "r", TOK.encode("a prompt long enough to span several blocks of four"),
        SamplingParams(max_tokens=20, ignore_eos=True), None, outputs.append,
    )  # fmt: skip
    core.add_request(req)
    core.step()  # admission, prefill and the first token
    core.deliver_outputs()
    if corrupt:
        core.pool.corrupt(req.block_ids[1])
    run_to_completion(core, lambda: bool(outputs) and outputs[-1].finished)
    return "".join(o.text for o in outputs)


def test_output_depends_on_the_kv_read_back_from_the_pool() -> None:
    # A block in the *middle* of the prompt, already past prefill, still changes the output:
    # the prompt digest covers it and the decode window re-reads recent blocks.
    clean = _run_with_corruption(False)
    assert clean == _run_with_corruption(False)
    # Prompt digest already taken; only a re-read could notice. Corrupt the block the decode
    # window reads instead, through the engine's own pool.
    core = EngineCore(EngineConfig(block_size=4))
    outputs: list[Output] = []
    ids = TOK.encode("a prompt long enough to span several blocks of four")
    req = SimRequest("r", "r", ids, SamplingParams(max_tokens=20, ignore_eos=True), None,
                     outputs.append)  # fmt: skip
    core.add_request(req)
    core.step()
    core.deliver_outputs()
    core.pool.corrupt(req.block_ids[len(req.all_token_ids) // 4])
    run_to_completion(core, lambda: bool(outputs) and outputs[-1].finished)
    assert "".join(o.text for o in outputs) != clean


def test_corrupt_prompt_kv_before_prefill_changes_output() -> None:
    ids = TOK.encode("a prompt long enough to span several blocks of four")
    clean = reference_completion(ids, 20, EngineConfig(block_size=4), ignore_eos=True)
    # A request whose first prompt tokens arrive as (wrong) external KV: simulate by
    # pre-filling the blocks with corrupted values and declaring them computed.
    core = EngineCore(EngineConfig(block_size=4))
    outputs: list[Output] = []
    req = SimRequest("r", "r", ids, SamplingParams(max_tokens=20, ignore_eos=True), None,
                     outputs.append)  # fmt: skip
    core.add_request(req)
    blocks = core.pool.allocate(core.pool.blocks_for(len(ids) + 1))
    assert blocks is not None
    core.pool.write(blocks, 0, core.model.kv_for(req.hashes[:8]))
    core.pool.corrupt(blocks[0])
    core.waiting.clear()
    req.block_ids, req.num_computed = blocks, 8
    req.state = req.state.PREFILL
    core.running[req.request_id] = req
    run_to_completion(core, lambda: bool(outputs) and outputs[-1].finished)
    assert "".join(o.text for o in outputs) != clean
    # The same pre-filled KV without corruption reproduces the reference exactly.
    core2 = EngineCore(EngineConfig(block_size=4))
    outputs2: list[Output] = []
    req2 = SimRequest("r", "r", ids, SamplingParams(max_tokens=20, ignore_eos=True), None,
                      outputs2.append)  # fmt: skip
    core2.add_request(req2)
    blocks2 = core2.pool.allocate(core2.pool.blocks_for(len(ids) + 1))
    assert blocks2 is not None
    core2.pool.write(blocks2, 0, core2.model.kv_for(req2.hashes[:8]))
    core2.waiting.clear()
    req2.block_ids, req2.num_computed = blocks2, 8
    req2.state = req2.state.PREFILL
    core2.running[req2.request_id] = req2
    run_to_completion(core2, lambda: bool(outputs2) and outputs2[-1].finished)
    assert "".join(o.text for o in outputs2) == clean
    assert core2.counters["prompt_tokens_loaded"] == 8


def test_reference_is_deterministic_and_respects_limits() -> None:
    msgs = [{"role": "user", "content": "Hello"}]
    assert reference_chat(msgs, 25) == reference_chat(msgs, 25)
    long = reference_completion("x", 200, ignore_eos=True)
    assert long and set(long) <= set(string.printable)
    # Without ignore_eos the model stops by itself well before a large budget.
    assert len(reference_completion("x", 2000)) < len(
        reference_completion("x", 2000, ignore_eos=True)
    )


def test_preemption_recomputes_and_keeps_output() -> None:
    # A pool too small for two long requests at once: one is preempted and recomputed.
    config = EngineConfig(num_blocks=12, block_size=4, max_model_len=40)
    core = EngineCore(config)
    results: dict[str, list[Output]] = {"a": [], "b": []}
    for name in results:
        core.add_request(SimRequest(
            name, name, TOK.encode(f"request {name} wants many blocks"),
            SamplingParams(max_tokens=25, ignore_eos=True), None, results[name].append,
        ))  # fmt: skip
    run_to_completion(core, lambda: all(r and r[-1].finished for r in results.values()))
    assert core.counters["preemptions"] > 0
    for name, outs in results.items():
        text = "".join(o.text for o in outs)
        ids = TOK.encode(f"request {name} wants many blocks")
        assert text == reference_completion(ids, 25, config, ignore_eos=True)
    assert core.pool.num_free == config.num_blocks


def test_concurrency_limit_queues_the_rest() -> None:
    core = EngineCore(EngineConfig(max_num_seqs=2))
    done: list[Output] = []
    for i in range(5):
        core.add_request(SimRequest(
            f"q{i}", f"q{i}", TOK.encode(f"queued {i}"),
            SamplingParams(max_tokens=6, ignore_eos=True), None,
            lambda o: done.append(o) if o.finished else None,
        ))  # fmt: skip
    most = 0
    while len(done) < 5:
        core.step()
        core.deliver_outputs()
        most = max(most, len(core.running))
        assert len(core.running) + len(core.waiting) + len(done) == 5
    assert most == 2 and core.pool.num_free == core.pool.num_blocks
