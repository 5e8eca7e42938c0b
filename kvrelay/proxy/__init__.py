"""kvrelay proxy: an OpenAI-compatible router in front of prefill (P) and decode (D) engines
that reuses a conversation's KV across turns. Entry points: `kvrelay.proxy.http.app.create_app`,
`kvrelay.proxy.http.server.serve`, the `kvrelay` command (`kvrelay.proxy.cli`)."""
