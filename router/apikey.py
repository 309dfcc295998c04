"""Optional API key on the HTTP API (``Authorization: Bearer <key>``).

When a key is configured, every ``/v1/*``, ``/admin/*``, ``/tokenize``, ``/detokenize`` and
``/tokenizer_info`` request must carry it; others get HTTP 401 with an OpenAI error body (code
``invalid_api_key``). ``/health`` and ``/metrics`` stay open for probes and scrapers.
"""

from __future__ import annotations

import hmac

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

PROTECTED_PREFIXES = ("/v1/", "/admin/", "/tokenize", "/detokenize", "/tokenizer_info")


def install_api_key(app: FastAPI, api_key: str | None) -> None:
    """Require ``api_key`` on protected routes; no-op when ``api_key`` is None or empty."""
    if not api_key:
        return
    expected = api_key.encode()

    @app.middleware("http")
    async def _check_api_key(request: Request, call_next):
        if request.url.path.startswith(PROTECTED_PREFIXES):
            header = request.headers.get("authorization", "")
            scheme, _, token = header.partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), expected):
                return JSONResponse(status_code=401, content={"error": {
                    "message": "Incorrect or missing API key: send 'Authorization: Bearer <key>'.",
                    "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}})
        return await call_next(request)
