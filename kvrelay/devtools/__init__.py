"""Tools for running a kvrelay fleet on one machine: the demo, the tests and the benchmarks.

Reading order: `process` (free ports, bounded waits, server subprocesses that are always
stopped with their children), `redis` (a throw-away `redis-server`), `prometheus` (reading a
`/metrics` page), `sse` (reading an OpenAI-style event stream as a client does). The proxy imports
only `prometheus.parse_samples`/`series_sum` (pure text parsing, for its engine load signals);
nothing here needs torch or nixl.
"""
