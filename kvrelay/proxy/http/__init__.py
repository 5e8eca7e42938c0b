"""The client-facing HTTP side: the aiohttp application and its routes, admin API, pass-through
routes, keys and admission, body and header reading, request validation, OpenAPI, and the
server process (uvloop, workers, supervisor). `app` is exported as a module too: the bench's
feature switches replace its collaborators by name (`bench/_features_off.py`).
"""

from kvrelay.proxy.http import app
from kvrelay.proxy.http.server import serve

__all__ = ["app", "serve"]
