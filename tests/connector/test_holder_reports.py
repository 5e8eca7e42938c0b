"""A holder rank reports each of its holds in finished_sending exactly once.

vLLM counts finished_sending reports across ranks (every rank once makes a request done) and
asserts on ids it no longer knows, so a rank whose readers' notifications already freed a hold
must not report it again when the scheduler's metadata orders the same hold freed (a release
or the lease of a rank whose notification never arrived). NIXL is not involved: the fake
transport below only hands the worker read notifications.
"""

from __future__ import annotations

from collections import Counter

from kvrelay.connector.config import ConnectorConfig
from kvrelay.connector.metadata import ConnectorMetadata
from kvrelay.connector.worker import ConnectorWorker, notif_message
from kvrelay.devtools import nixl_peer


class FakeNotifTransport:
    """Stands in for a holder rank's NIXL agent: delivers queued read notifications."""

    def __init__(self) -> None:
        self.pending: list[bytes] = []

    def notifications(self) -> dict[str, list[bytes]]:
        out, self.pending = self.pending, []
        return {"reader-agent": out} if out else {}

    def close(self) -> None:
        return None


def _holder_ranks(tp_size: int) -> list[tuple[ConnectorWorker, FakeNotifTransport]]:
    config = ConnectorConfig(engine_id="holder", secret=nixl_peer.SECRET, block_size=4, model="m")
    ranks = []
    for rank in range(tp_size):
        worker = ConnectorWorker(config, rank, tp_size)
        fake = FakeNotifTransport()
        worker._transport = fake  # type: ignore[assignment]
        ranks.append((worker, fake))
    return ranks


def _step(
    ranks: list[tuple[ConnectorWorker, FakeNotifTransport]], meta: ConnectorMetadata
) -> list[str]:
    reported: list[str] = []
    for worker, _ in ranks:
        worker.start_load_kv(meta)
        sending, _ = worker.get_finished()
        reported.extend(sending)
    return reported


def test_a_rank_whose_reader_notified_does_not_report_the_later_free_again() -> None:
    ranks = _holder_ranks(2)
    try:
        reports: Counter[str] = Counter()
        reports.update(_step(ranks, ConnectorMetadata(reqs_to_hold={"h1": 0.0})))
        # Rank 0's reader notified; rank 1's notification was lost (its read failed).
        ranks[0][1].pending.append(notif_message("h1", 1))
        reports.update(_step(ranks, ConnectorMetadata()))
        assert reports == Counter({"h1": 1})
        # The failed reader's release (or the lease) orders the hold freed on every rank.
        reports.update(_step(ranks, ConnectorMetadata(reqs_to_free={"h1"})))
        reports.update(_step(ranks, ConnectorMetadata(reqs_to_free={"h1"})))
        # One report per rank: vLLM's count reaches the world size exactly once.
        assert reports == Counter({"h1": 2})
    finally:
        for worker, _ in ranks:
            worker.shutdown()
