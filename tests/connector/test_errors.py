"""The connector's exceptions share one root whose `kind` is an enum, and counter names stay."""

from __future__ import annotations

import pytest

from kvrelay.connector.errors import ConnectorError, ConnectorErrorKind
from kvrelay.connector.layout import LayoutError
from kvrelay.connector.sidechannel_client import HolderNotAllowedError, SideChannelError
from kvrelay.connector.tp import TPMismatchError
from kvrelay.connector.vllm.layout import UnsupportedCacheError
from kvrelay.connector.vllm.settings import UnsupportedConfigError


@pytest.mark.parametrize(
    ("error", "kind"),
    [
        (SideChannelError("x", 503), ConnectorErrorKind.SIDE_CHANNEL),
        (HolderNotAllowedError("x"), ConnectorErrorKind.HOLDER_NOT_ALLOWED),
        (TPMismatchError("x"), ConnectorErrorKind.TP_MISMATCH),
        (LayoutError("x"), ConnectorErrorKind.LAYOUT),
        (UnsupportedConfigError("x"), ConnectorErrorKind.UNSUPPORTED_CONFIG),
        (UnsupportedCacheError("x"), ConnectorErrorKind.UNSUPPORTED_CACHE),
    ],
)
def test_every_connector_error_has_the_root_and_its_kind(
    error: ConnectorError, kind: ConnectorErrorKind
) -> None:
    assert isinstance(error, ConnectorError)
    assert error.kind is kind
    assert str(error) == "x"


def test_value_errors_stay_value_errors() -> None:
    # Callers that caught the built-in base before the root existed still catch them.
    for cls in (TPMismatchError, LayoutError, UnsupportedConfigError, UnsupportedCacheError):
        assert issubclass(cls, ValueError)


def test_load_failure_kinds_keep_their_counter_names_and_release_rule() -> None:
    pytest.importorskip("torch")
    from kvrelay.connector.transport import TransportError
    from kvrelay.connector.worker import LoadFailure

    assert TransportError("x").kind is ConnectorErrorKind.TRANSPORT
    failure = LoadFailure(ConnectorErrorKind.GONE, "holder no longer holds the blocks")
    assert isinstance(failure, ConnectorError)
    assert failure.kind.value == "gone"
    # The worker's `failures_<value>` counters are exported as engine metrics: names are stable.
    load_kinds = {"setup", "claim", "claimed", "gone", "handshake", "incompatible", "transfer",
                  "timeout", "exception"}  # fmt: skip
    assert load_kinds <= {k.value for k in ConnectorErrorKind}
    # A reader releases the holder's blocks after a failed load unless they are gone or another
    # reader claimed them.
    releasing = {k.value for k in ConnectorErrorKind if k.releases_holder} & load_kinds
    assert releasing == load_kinds - {"gone", "claimed"}
