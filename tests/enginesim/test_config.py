"""The engine's connector settings are the connector's own `ConnectorConfig`, validated at once."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from kvrelay.connector.config import ConnectorConfig
from kvrelay.enginesim.cli import build_parser, config_from_args
from kvrelay.enginesim.nixl_host import connector_config


def _config(*argv: str) -> ConnectorConfig:
    engine = config_from_args(build_parser().parse_args(list(argv)))
    assert isinstance(engine.connector, ConnectorConfig)
    return connector_config(engine)


def test_cli_flags_and_pool_identity_reach_the_connector() -> None:
    cfg = _config(
        "--port", "8123", "--side-channel-port", "0", "--kv-load-failure-policy", "fail",
        "--lease-seconds", "7", "--block-size", "32", "--num-layers", "3", "--dtype", "float32",
        "--no-publish-finished-params",
    )  # fmt: skip
    assert cfg.engine_id == "sim-8123"
    assert cfg.kv_load_failure_policy == "fail"
    assert cfg.lease_seconds == 7.0
    assert (cfg.block_size, cfg.num_layers, cfg.dtype, cfg.tp_size) == (32, 3, "float32", 1)
    assert cfg.kv_layout == "kv_first"
    assert cfg.publish_finished_params is False
    assert cfg.claim_timeout_s == 30.0  # the connector's own default, left unset
    assert _config("--side-channel-port", "0", "--claim-timeout", "1.5").claim_timeout_s == 1.5


def test_no_side_channel_means_no_connector() -> None:
    assert config_from_args(build_parser().parse_args([])).connector is None


def test_bad_connector_values_fail_before_the_engine_starts() -> None:
    with pytest.raises(ValidationError):
        _config("--side-channel-port", "0", "--lease-seconds", "0")
    with pytest.raises(ValidationError):
        _config("--side-channel-port", "70000")
