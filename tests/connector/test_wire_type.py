"""`kv_transfer_params` have one type, `KVTransferParams`: every place that reads or writes them
goes through it, and no other class models the same fields.

The structural checks read the code with `ast`: a class (outside the wire type and what derives
from it) that declares the four fields of a hold, by any of their spellings, is a second model
of the params; so is a module outside the connector's protocol that spells the params' field
names out as strings.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import pytest

from kvrelay.connector.protocol import HoldRef, KVTransferParams
from kvrelay.kvcache_map import KVEntry
from kvrelay.proxy.turn.legs import decode_body, prefill_body

ROOT = Path(__file__).resolve().parents[2]
# The hold's fields and the spellings a parallel model has used for them.
_HOLD = {
    "host": {"host", "remote_host"},
    "port": {"port", "remote_port"},
    "request_id": {"request_id", "remote_request_id"},
    "token": {"token", "release_token"},
}
# The wire type and what derives from it; KVEntry is the map's stored form, whose fields map to
# the wire's in one table (`_entry._WIRE`) and which is built from and replayed as the wire type.
_ALLOWED = {"KVTransferParams", "HoldRef", "KVEntry", "_ReferenceEntry"}
_WIRE_NAMES = set(KVTransferParams.model_fields)


def _classes() -> list[tuple[Path, ast.ClassDef]]:
    found = []
    for path in sorted((ROOT / "kvrelay").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                found.append((path, node))
    return found


def _fields(node: ast.ClassDef) -> set[str]:
    return {
        stmt.target.id
        for stmt in node.body
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
    }


def test_no_other_class_models_a_hold() -> None:
    parallel = [
        f"{path.relative_to(ROOT)}:{node.name}"
        for path, node in _classes()
        if node.name not in _ALLOWED
        and all(_fields(node) & spellings for spellings in _HOLD.values())
    ]
    assert not parallel, f"model the hold as HoldRef (derived from KVTransferParams): {parallel}"


def test_no_other_class_declares_wire_fields() -> None:
    offenders = {
        f"{path.relative_to(ROOT)}:{node.name}": sorted(_fields(node) & _WIRE_NAMES)
        for path, node in _classes()
        if node.name not in _ALLOWED and len(_fields(node) & _WIRE_NAMES) >= 4
    }
    # The worker's read spec names where to read from (not a hold, not params): it carries the
    # hold as a HoldRef.
    offenders.pop("kvrelay/connector/metadata.py:RecvSpec", None)
    assert not offenders, offenders


def test_only_the_protocol_spells_the_field_names() -> None:
    spelled = []
    names = _WIRE_NAMES - {"tp_size"}  # also the handshake's own field
    for path in sorted((ROOT / "kvrelay").rglob("*.py")):
        if path.name == "protocol.py" and path.parent.name == "connector":
            continue
        # The entry's own field names (its stored form) are not the wire's.
        own = set(KVEntry.model_fields) if path.name == "_entry.py" else set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value in names - own:
                spelled.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.value}")
    assert not spelled, spelled


def _d_params(**changes: Any) -> dict[str, Any]:
    params: dict[str, Any] = {
        "do_remote_prefill": False,
        "do_remote_decode": True,
        "remote_engine_id": "decode-0",
        "remote_request_id": "cmpl-7",
        "remote_host": "10.0.0.7",
        "remote_port": 7601,
        "remote_block_ids": [[10, 11, 12]],
        "remote_num_tokens": 41,
        "tp_size": 1,
        "remote_blocks_expiry_time": 2e9,
        "remote_block_hashes": ["00112233445566aa", "00112233445566bb"],
        "release_token": "secret-token",
        "kvr_prompt_tokens": 41,
        "kvr_local_hit_tokens": 0,
        "kvr_loaded_tokens": 32,
        "kvr_offered_blocks": 3,
        "kvr_refused_blocks": {"partial": 1},
        "vendor_field": {"kept": True},
    }
    params.update(changes)
    return params


def test_wire_round_trip_keeps_every_field_and_only_those_given() -> None:
    wire = _d_params()
    parsed = KVTransferParams.from_wire(wire)
    assert parsed is not None and parsed.to_wire() == wire
    assert parsed.kvr_refused_blocks == {"partial": 1} and parsed.kvr_loaded_tokens == 32
    assert KVTransferParams.from_wire(parsed) is parsed  # parsed once, never again
    assert KVTransferParams.from_wire({"hold_blocks": True}).to_wire() == {"hold_blocks": True}  # type: ignore[union-attr]


@pytest.mark.parametrize(
    "bad",
    [
        {"remote_port": "7601"},
        {"remote_num_tokens": 41.0},
        {"do_remote_decode": "true"},
        {"remote_block_ids": [[1, True]]},
        {"kvr_loaded_tokens": "32"},
        {"kvr_refused_blocks": {"hash": "1"}},
    ],
)
def test_wrong_types_are_refused_at_the_edge(bad: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        KVTransferParams.from_wire(_d_params(**bad))
    assert KVTransferParams.from_wire_or_none(_d_params(**bad)) is None
    assert KVTransferParams.from_wire_or_none("not an object") is None


@pytest.mark.parametrize(
    ("field", "given", "parsed"),
    [
        ("remote_block_ids", [[1, 2], [3]], [[1, 2], [3]]),
        ("remote_block_ids", ((1, 2), [3]), [[1, 2], [3]]),  # an engine in the same process
        ("remote_block_ids", [(1, 2)], [[1, 2]]),
        ("remote_block_ids", [], []),
        ("remote_block_hashes", ["ab", "cd"], ["ab", "cd"]),
        ("remote_block_hashes", ("ab", "cd"), ["ab", "cd"]),
    ],
)
def test_lists_and_tuples_are_taken_as_lists(field: str, given: Any, parsed: Any) -> None:
    value = getattr(KVTransferParams.from_wire(_d_params(**{field: given})), field)
    assert value == parsed and type(value) is list
    assert all(type(group) is list for group in value if field == "remote_block_ids")


@pytest.mark.parametrize(
    ("field", "given"),
    [
        ("remote_block_ids", [{1, 2}]),
        ("remote_block_ids", ({1, 2},)),
        ("remote_block_ids", {(1, 2)}),
        ("remote_block_ids", [[1, 2.0]]),
        ("remote_block_ids", ([1, False],)),
        ("remote_block_ids", [1, 2]),
        ("remote_block_ids", [[1, 2], "3"]),
        ("remote_block_ids", ["12"]),
        ("remote_block_ids", ([x for x in (1, 2)] for _ in range(1))),
        ("remote_block_hashes", {"ab"}),
        ("remote_block_hashes", ["ab", 1]),
        ("remote_block_hashes", ("ab", None)),
        ("remote_block_hashes", "abcd"),
        ("remote_block_hashes", [b"ab"]),
    ],
)
def test_other_collections_and_items_are_refused(field: str, given: Any) -> None:
    """Only lists (JSON) and tuples (an engine in the same process) of the right items: no
    sets, generators or strings, whichever of the two checks sees them."""
    assert KVTransferParams.from_wire_or_none(_d_params(**{field: given})) is None


def test_parsed_params_share_no_list_with_the_wire() -> None:
    wire = _d_params()
    parsed = KVTransferParams.from_wire(wire)
    wire["remote_block_ids"][0].append(99)
    assert parsed is not None and parsed.remote_block_ids == [[10, 11, 12]]


def test_the_hold_is_derived_from_the_params() -> None:
    parsed = KVTransferParams.from_wire(_d_params())
    assert parsed is not None
    hold = parsed.hold_ref
    assert isinstance(hold, HoldRef) and isinstance(hold, KVTransferParams)
    assert hold.to_wire() == {
        "remote_host": "10.0.0.7", "remote_port": 7601, "remote_request_id": "cmpl-7",
        "release_token": "secret-token",
    }  # fmt: skip
    stock = KVTransferParams.from_wire(_d_params(release_token=None))
    assert stock is not None and stock.hold_ref is None


def test_entry_and_legs_go_through_the_type() -> None:
    """D's params → entry → P's params → P's answer → D's params, all as the one type."""
    entry = KVEntry.from_kv_transfer_params(_d_params(), url="http://d0:8000", fingerprint="fp")
    replay = entry.to_kv_transfer_params()
    assert isinstance(replay, KVTransferParams)
    assert entry.hold_ref == KVTransferParams.from_wire(_d_params()).hold_ref  # type: ignore[union-attr]
    again = KVEntry.from_kv_transfer_params(replay, url=entry.url, fingerprint="fp")
    assert again == entry
    p_body = prefill_body({"prompt": "x"}, replay)
    sent = p_body["kv_transfer_params"]
    assert sent == {**replay.to_wire(), "do_remote_decode": True, "do_remote_prefill": False}
    p_answer = KVTransferParams.from_wire(_d_params(do_remote_prefill=True))
    d_body = decode_body({"prompt": "x"}, p_answer, "http://p0:8000", hold=True)
    assert d_body["kv_transfer_params"] == {
        **_d_params(), "do_remote_prefill": True, "do_remote_decode": False,
        "remote_url": "http://p0:8000", "hold_blocks": True,
    }  # fmt: skip
    # Params that do not parse are none: D prefills.
    unusable = KVTransferParams.from_wire_or_none({"remote_port": "1"})
    assert "kv_transfer_params" not in decode_body({"prompt": "x"}, unusable, None, hold=False)
