"""Settings: every knob (env `KVRELAY_*`, `.env`, `kvrelay serve --flag`) and their start-up
validation; the value grammars the settings check (`specs.py`) sit below them.
"""

from kvrelay.proxy.config.settings import (
    LogFormat,
    Settings,
    SettingsError,
    TracingMode,
    env_name,
    flag_name,
    load_settings,
    normalize_backend_url,
)
from kvrelay.proxy.config.specs import parse_dns_spec, parse_limit

__all__ = [
    "LogFormat",
    "Settings",
    "SettingsError",
    "TracingMode",
    "env_name",
    "flag_name",
    "load_settings",
    "normalize_backend_url",
    "parse_dns_spec",
    "parse_limit",
]
