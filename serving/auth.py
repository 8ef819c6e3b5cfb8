"""ApiKeys: bearer-token authentication shared by the HTTP and gRPC front ends.

A server started with one or more keys (``jbatch serve --api-key KEY``, repeatable, or the
``JBATCH_API_KEY`` environment variable) accepts a request only when it carries
``Authorization: Bearer KEY`` (HTTP header, or gRPC ``authorization`` metadata) for one of them.
The comparison is constant-time (``hmac.compare_digest`` against every key, no early exit) and
the keys never appear in a repr, a log line or an error message. Health checks stay open; so
does ``/metrics`` unless ``protect_metrics`` is set.
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Iterable

ENV_VAR = "JBATCH_API_KEY"
_SCHEME = "bearer"


class ApiKeys:
    """The accepted keys (none: authentication is off)."""

    def __init__(self, keys: Iterable[str] = (), *, protect_metrics: bool = False):
        encoded = []
        for i, key in enumerate(keys):
            if not isinstance(key, str) or not key or key != key.strip() or " " in key:
                raise ValueError(f"api key #{i + 1} must be a non-empty string without spaces")
            encoded.append(key.encode())
        self._keys = tuple(encoded)
        self.protect_metrics = protect_metrics

    @classmethod
    def from_flags(cls, keys: Iterable[str] | None, protect_metrics: bool = False) -> ApiKeys:
        """``--api-key`` values, else ``JBATCH_API_KEY`` (one key), else none."""
        keys = list(keys or ())
        if not keys and os.environ.get(ENV_VAR):
            keys = [os.environ[ENV_VAR]]
        return cls(keys, protect_metrics=protect_metrics)

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def __repr__(self) -> str:  # never the keys themselves
        return f"ApiKeys({len(self._keys)} key(s), protect_metrics={self.protect_metrics})"

    def allows(self, authorization: str | bytes | None) -> bool:
        """Whether an ``Authorization`` value grants access (always, when auth is off)."""
        if not self._keys:
            return True
        if isinstance(authorization, bytes):
            authorization = authorization.decode("latin-1")
        scheme, _, token = (authorization or "").strip().partition(" ")
        given = token.strip().encode("utf-8", "surrogateescape")
        ok = False
        for key in self._keys:  # every key is compared: the time does not tell which matched
            ok |= hmac.compare_digest(given, key)
        return ok and scheme.lower() == _SCHEME

    def is_open_http_path(self, path: str) -> bool:
        """Paths served without a key: ``/health`` and (unless protected) ``/metrics``."""
        return path == "/health" or (path == "/metrics" and not self.protect_metrics)


UNAUTHENTICATED_MESSAGE = (
    "missing or invalid API key: send 'Authorization: Bearer <key>' (gRPC: 'authorization' "
    "metadata)"
)
