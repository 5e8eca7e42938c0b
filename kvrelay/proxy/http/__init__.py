"""The client-facing HTTP side: the aiohttp application and its routes, admin API, pass-through
routes, keys and admission, body and header reading, request validation, OpenAPI, and the
server process (uvloop, workers, supervisor). `app` is exported as a module too: the bench's
feature switches replace its collaborators by name (`bench/_features_off.py`). The request
checks and the declarations they follow (`request_bodies`, as a module) are priced by
`bench/request_checks.py`. A worker's collector tuning (`GC_YOUNG_THRESHOLD`) is what
`bench/kv_events_replay.py` runs its feed under.
"""

from kvrelay.proxy.http import app, request_bodies
from kvrelay.proxy.http.server import GC_YOUNG_THRESHOLD, serve
from kvrelay.proxy.http.validation import validate_chat, validate_completion

__all__ = [
    "GC_YOUNG_THRESHOLD",
    "app",
    "request_bodies",
    "serve",
    "validate_chat",
    "validate_completion",
]
