"""Side-by-side benchmarks, run as modules from the repository root: `python -m bench.<name>`.

Not part of the wheel. Servers, Redis and load come from `kvrelay.devtools`; `bench/README.md`
gives the reading order.
"""
