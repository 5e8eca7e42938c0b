"""Whose KV a block is: the LoRA adapter and the cache salt (the tenant's cache scope) are part
of every block hash (no NIXL needed)."""

from __future__ import annotations

from collections.abc import Callable

from kvrelay.connector.block_hash import block_hashes
from kvrelay.connector.metadata import RequestView
from kvrelay.connector.scheduler import ConnectorScheduler

MakeScheduler = Callable[..., ConnectorScheduler]


def _hold(
    holder: ConnectorScheduler, lora: str | None, salt: str | None = None
) -> dict[str, object]:
    tokens = list(range(11))
    view = RequestView(
        "h1", None, tokens[:10], tokens, {"do_remote_decode": True}, lora_name=lora,
        cache_salt=salt,
    )  # fmt: skip
    delay, params = holder.request_finished(view, [[100, 101, 102]])
    assert delay and params is not None
    return params


def _matched(
    reader: ConnectorScheduler, params: dict[str, object], lora: str | None,
    salt: str | None = None,
) -> int:  # fmt: skip
    prompt = [*range(10), 99]
    view = RequestView(
        "r1", None, prompt, prompt,
        {**params, "do_remote_decode": True, "do_remote_prefill": False}, lora_name=lora,
        cache_salt=salt,
    )  # fmt: skip
    n, _ = reader.get_num_new_matched_tokens(view, 0)
    return n


def test_block_hashes_are_seeded_with_the_lora_adapter() -> None:
    tokens = list(range(8))
    base = block_hashes(tokens, 4, "c")
    assert block_hashes(tokens, 4, "c", lora_name=None) == base
    assert block_hashes(tokens, 4, "c", lora_name="a")[0] != base[0]
    assert block_hashes(tokens, 4, "c", lora_name="a") != block_hashes(
        tokens, 4, "c", lora_name="b"
    )


def test_kv_of_another_lora_adapter_is_never_pulled(make_scheduler: MakeScheduler) -> None:
    holder = make_scheduler(engine_id="holder")
    reader = make_scheduler(engine_id="reader")
    with_a = _hold(holder, "adapter-a")
    assert _matched(reader, with_a, "adapter-b") == 0
    assert _matched(reader, with_a, None) == 0
    base = make_scheduler(engine_id="holder-base")
    assert _matched(make_scheduler(engine_id="reader-2"), _hold(base, None), "adapter-a") == 0
    assert _matched(make_scheduler(engine_id="reader-3"), _hold(base, None), None) == 8
    assert _matched(make_scheduler(engine_id="reader-4"), with_a, "adapter-a") == 8


def test_block_hashes_are_seeded_with_the_cache_salt() -> None:
    tokens = list(range(8))
    base = block_hashes(tokens, 4, "c")
    salted = block_hashes(tokens, 4, "c", cache_salt="tenant-a")
    assert salted[0] != base[0] and salted != block_hashes(tokens, 4, "c", cache_salt="tenant-b")
    # The salt and the adapter are separate seeds: neither stands in for the other.
    assert block_hashes(tokens, 4, "c", lora_name="x", cache_salt="y") != block_hashes(
        tokens, 4, "c", lora_name="y", cache_salt="x"
    )


def test_kv_held_under_another_cache_salt_is_never_pulled(make_scheduler: MakeScheduler) -> None:
    # One tenant's held blocks never verify for another tenant's identical prompt.
    holder = make_scheduler(engine_id="holder")
    tenant_a = _hold(holder, None, "salt-a")
    assert _matched(make_scheduler(engine_id="reader-b"), tenant_a, None, "salt-b") == 0
    assert _matched(make_scheduler(engine_id="reader-none"), tenant_a, None) == 0
    assert _matched(make_scheduler(engine_id="reader-a"), tenant_a, None, "salt-a") == 8


def test_d_leg_pulls_the_partial_tail_only_when_its_tokens_match(
    make_scheduler: MakeScheduler,
) -> None:
    holder = make_scheduler(engine_id="holder")
    reader = make_scheduler(engine_id="reader")
    prompt = list(range(10))  # blocks of 4: two full blocks and a 2-token tail
    view = RequestView("p1", None, prompt, [*prompt, 50], {"do_remote_decode": True})
    _, params = holder.request_finished(view, [[100, 101, 102]])
    assert params is not None and params["remote_num_tokens"] == 10

    def d_leg(rid: str, d_prompt: list[int], p: dict[str, object]) -> int:
        n, _ = reader.get_num_new_matched_tokens(RequestView(rid, None, d_prompt, d_prompt, p), 0)
        return n

    # The same prompt: the tail comes too (all but the last token, which D computes).
    assert d_leg("d1", prompt, params) == 9
    # A tail token differs: only the verified full blocks are pulled.
    assert d_leg("d2", [*prompt[:8], 77, 9], params) == 8
    # Params without the tail's hash (a holder that cannot vouch for it): full blocks only.
    assert d_leg("d3", prompt, {k: v for k, v in params.items() if k != "remote_tail_hash"}) == 8
