"""kvrelay proxy: an OpenAI-compatible router in front of prefill (P) and decode (D) engines
that reuses a conversation's KV across turns. Its rooms (`http`, `turn`, `tenants`, `fleet`,
`engines`, `telemetry`, `config`, `base`) are sub-packages, each used through its face (see
README.md). Entry points: `kvrelay.proxy.http.app.create_app`, `kvrelay.proxy.http.serve`, the
`kvrelay` command (`kvrelay.proxy.cli`)."""
