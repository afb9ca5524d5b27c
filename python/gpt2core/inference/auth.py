"""Who may call gpt2core-serve: the API keys (--api-key-file and GPT2CORE_API_KEY), the ASGI gate that checks
`Authorization: Bearer <key>` in constant time on every route but /health and the page, and the loopback check
behind the warning for a server without a key bound to another address."""
from __future__ import annotations

import hmac
import ipaddress
import json
import os
from pathlib import Path

from ..errors import ArgError
from .protocol import APIError


API_KEY_ENV = "GPT2CORE_API_KEY"


def read_api_keys(path: str | None, env: dict | None = None) -> list[str]:
    """The keys the server accepts: one a line of `path` (--api-key-file; blank lines and lines starting with #
    skipped) and the environment variable GPT2CORE_API_KEY (a key on the command line would show in `ps`)."""
    keys = []
    if path is not None:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ArgError(f"--api-key-file {path}: cannot read it: {getattr(e, 'strerror', None) or e}") from None
        keys = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.strip().startswith("#")]
        if not keys:
            raise ArgError(f"--api-key-file {path}: no key in it (one key a line)")
    env_key = (os.environ if env is None else env).get(API_KEY_ENV, "").strip()
    if env_key:
        keys.append(env_key)
    return keys


class APIKeyGate:
    """ASGI middleware: every route but GET /health and the page at GET / (a static file; it asks for the key and
    sends it with its requests, as a browser cannot on a page load) needs `Authorization: Bearer <key>`, compared
    with each key in constant time; otherwise 401 in OpenAI's error shape."""

    OPEN = {("GET", "/health"), ("HEAD", "/health"), ("GET", "/"), ("HEAD", "/")}

    def __init__(self, app, keys: list[str]):
        self.app = app
        self.keys = [k.encode() for k in keys]

    def allowed(self, header: bytes | None) -> bool:
        if header is None or not header[:7].lower() == b"bearer ":
            return False
        given = header[7:].strip()
        ok = False
        for k in self.keys:  # every key compared, whatever matched: the time does not say which
            ok |= hmac.compare_digest(given, k)
        return ok

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or (scope["method"], scope["path"]) in self.OPEN or scope["method"] == "OPTIONS":
            return await self.app(scope, receive, send)
        given = [v for k, v in scope["headers"] if k.lower() == b"authorization"]
        header = given[0] if len(given) == 1 else None  # two Authorization headers: neither is believed
        if self.allowed(header):
            return await self.app(scope, receive, send)
        msg = "incorrect API key provided" if given else \
            "a valid API key is required: send Authorization: Bearer <key>"
        if len(given) > 1:
            msg = "send one Authorization header: this request has " + str(len(given))
        body = json.dumps(APIError(401, msg, None, "invalid_api_key").body()).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": body})


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return host == "localhost"
