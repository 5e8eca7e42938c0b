"""The client-facing HTTP side: the aiohttp application and its routes, admin API, pass-through
routes, keys and admission, body and header reading, request validation, OpenAPI, and the
server process (uvloop, workers, supervisor). `app` is exported as a module too: the bench's
feature switches replace its collaborators by name (`bench/_features_off.py`). The request
checks and the declarations they follow (`request_bodies`, as a module) are priced by
`bench/request_checks.py`.
"""

from kvrelay.proxy.http import app, request_bodies
from kvrelay.proxy.http.server import serve
from kvrelay.proxy.http.validation import validate_chat, validate_completion

__all__ = ["app", "request_bodies", "serve", "validate_chat", "validate_completion"]
