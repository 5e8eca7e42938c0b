"""vLLM configuration -> `ConnectorConfig`, and the start-up checks of what the adapter supports.

Operator knobs come from `kv_transfer_config.kv_connector_extra_config` (keys listed in
`EXTRA_KEYS`, documented in the README); the KV format identity (model, dtype, block size,
layers, MLA, TP) comes from vLLM itself so P and D agree by construction. The shared secret
is never a config key: it comes from `KVRELAY_CONNECTOR_SECRET`.
"""

from __future__ import annotations

from typing import Any

from kvrelay.connector.config import ConnectorConfig
from kvrelay.connector.errors import ConnectorError, ConnectorErrorKind

# extra-config key -> ConnectorConfig field (same names; listed so typos fail loudly).
EXTRA_KEYS = (
    "side_channel_host",
    "side_channel_port",
    "advertise_host",
    "lease_seconds",
    "hold_budget_fraction",
    "hold_max_fraction",
    "hold_brief_max_fraction",
    "hold_brief_lease_s",
    "claim_timeout_s",
    "publish_finished_params",
    "finished_params_ttl_s",
    "finished_params_max",
    "kv_recompute_threshold",
    "require_block_hashes",
    "handshake_timeout_s",
    "handshake_retries",
    "transfer_timeout_s",
    "cancel_grace_s",
    "coalesce",
    "prepared_reads",
    "nixl_threads",
    "claim_concurrency_per_holder",
    "holder_retry_s",
    "max_quarantined_blocks",
    "allowed_holders",
    "side_channel_aliases",
    "release_attempts",
    "release_timeout_s",
    "release_concurrency_per_holder",
)
# Adapter-only keys (not ConnectorConfig fields).
ADAPTER_KEYS: tuple[str, ...] = ("block_major",)
# The block-outermost layout the connector asks vLLM for (vllm/v1/kv_cache_layout.py): every
# block holds all layers' pages, so a read posts one NIXL descriptor per run of blocks.
BLOCK_MAJOR_LAYOUT = "BLHNC"


def required_kvcache_layout(vllm_config: Any) -> str | None:
    """The KV cache layout to ask vLLM for: block-major unless `block_major` is false in the
    connector's extra config, or the engine runs on the CPU (its attention backend reads only
    per-layer pages, `LBHNC`). Where the attention backend accepts no block-outermost layout,
    vLLM says so in its log and keeps a per-layer one, which the connector registers as such."""
    kv_cfg = vllm_config.kv_transfer_config
    extra = dict(kv_cfg.kv_connector_extra_config or {}) if kv_cfg is not None else {}
    if not extra.get("block_major", True):
        return None
    if vllm_config.device_config.device_type == "cpu":
        return None
    return BLOCK_MAJOR_LAYOUT


class UnsupportedConfigError(ConnectorError, ValueError):
    """vLLM is configured in a way the kvrelay connector cannot serve; raised at start-up."""

    kind = ConnectorErrorKind.UNSUPPORTED_CONFIG


def check_supported(vllm_config: Any, kv_cache_config: Any) -> Any:
    """Fail with a clear message for set-ups the adapter does not handle; return the spec."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    groups = list(kv_cache_config.kv_cache_groups)
    specs = [g.kv_cache_spec for g in groups]
    if len(groups) != 1 or not isinstance(specs[0], FullAttentionSpec):
        kinds = ", ".join(sorted({type(s).__name__ for s in specs})) or "none"
        raise UnsupportedConfigError(
            "kvrelay connector: only models whose layers all use full attention (one KV-cache "
            f"group) are supported; this model has {len(groups)} group(s) of kind {kinds} "
            "(hybrid, sliding-window, chunked-local or Mamba layers). Use vLLM's own "
            "connector for it or run it without disaggregation."
        )
    if getattr(specs[0], "sliding_window", None):
        raise UnsupportedConfigError("kvrelay connector: sliding-window attention is not supported")
    parallel = vllm_config.parallel_config
    if parallel.pipeline_parallel_size > 1:
        raise UnsupportedConfigError(
            "kvrelay connector: pipeline parallelism (pipeline_parallel_size > 1) is not supported"
        )
    if (
        parallel.decode_context_parallel_size > 1
        or getattr(parallel, "prefill_context_parallel_size", 1) > 1
    ):
        raise UnsupportedConfigError(
            "kvrelay connector: context parallelism (decode/prefill_context_parallel_size > 1) "
            "is not supported"
        )
    kv_cfg = vllm_config.kv_transfer_config
    device = vllm_config.device_config.device_type
    buffer = kv_cfg.kv_buffer_device
    if device == "cpu" and buffer != "cpu":
        raise UnsupportedConfigError(
            "kvrelay connector on vLLM's CPU build needs "
            f'"kv_buffer_device": "cpu" (got {buffer!r})'
        )
    if device == "cuda" and buffer != "cuda":
        raise UnsupportedConfigError(
            'kvrelay connector on CUDA reads VRAM directly: set "kv_buffer_device": "cuda" '
            f"(got {buffer!r}; host staging buffers are not supported)"
        )
    if device not in ("cpu", "cuda"):
        raise UnsupportedConfigError(
            f"kvrelay connector supports vLLM on CPU and CUDA only (device {device!r})"
        )
    extra = dict(kv_cfg.kv_connector_extra_config or {})
    unknown = sorted(set(extra) - set(EXTRA_KEYS) - set(ADAPTER_KEYS))
    if unknown:
        raise UnsupportedConfigError(
            f"kvrelay connector: unknown kv_connector_extra_config key(s) {unknown}; "
            f"known: {sorted(EXTRA_KEYS + ADAPTER_KEYS)}"
        )
    if "secret" in extra:
        raise UnsupportedConfigError(
            "kvrelay connector: the side-channel secret comes from KVRELAY_CONNECTOR_SECRET, "
            "never from the config"
        )
    return specs[0]


def connector_config(vllm_config: Any, kv_cache_config: Any) -> ConnectorConfig:
    """Build the core's config for this engine (the same on the scheduler and every worker)."""
    spec = check_supported(vllm_config, kv_cache_config)
    kv_cfg = vllm_config.kv_transfer_config
    model_cfg = vllm_config.model_config
    extra = dict(kv_cfg.kv_connector_extra_config or {})
    served = model_cfg.served_model_name
    model = served[0] if isinstance(served, (list, tuple)) and served else served
    fields: dict[str, Any] = {k: extra[k] for k in EXTRA_KEYS if k in extra}
    try:
        return ConnectorConfig(
            engine_id=str(kv_cfg.engine_id),
            model=str(model or model_cfg.model),
            dtype=str(spec.dtype).removeprefix("torch."),
            block_size=int(spec.block_size),
            num_layers=len(kv_cache_config.kv_cache_groups[0].layer_names),
            kv_layout=f"vllm-{vllm_config.device_config.device_type}",
            use_mla=bool(model_cfg.use_mla),
            num_kv_heads=_model_int(model_cfg, "get_total_num_kv_heads"),
            head_dim=_model_int(model_cfg, "get_head_size"),
            tp_size=int(vllm_config.parallel_config.tensor_parallel_size),
            kv_load_failure_policy=kv_cfg.kv_load_failure_policy,
            **fields,
        )
    except ValueError as exc:  # pydantic's ValidationError is a ValueError
        raise UnsupportedConfigError(
            f"kvrelay connector: bad kv_connector_extra_config: {exc}"
        ) from exc


def _model_int(model_cfg: Any, getter: str) -> int | None:
    """A positive int from one of vLLM's ModelConfig getters, or None where it has none."""
    fn = getattr(model_cfg, getter, None)
    try:
        value = int(fn()) if callable(fn) else 0
    except (TypeError, ValueError, AttributeError):
        return None
    return value if value > 0 else None
