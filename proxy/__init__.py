"""kvrelay proxy: an OpenAI-compatible router in front of prefill (P) and decode (D) engines
that reuses a conversation's KV across turns. Entry points: `proxy.app.create_app`,
`proxy.server.serve`, the `kvrelay` command (`proxy.cli`)."""

__version__ = "0.1.0"
