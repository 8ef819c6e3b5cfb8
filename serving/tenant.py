"""Which tenant a request belongs to, read at the front ends (fair share: see
``jbatch/engine/tenants.py``).

HTTP: the ``X-Tenant-Id`` header, else the OpenAI ``user`` field. gRPC: the ``x-tenant-id``
metadata key, else the ``tenant`` field of ``GenerateRequest``. The transport-level key wins
(a gateway in front can set it whatever the body says); neither given (or empty) -> the
``default`` tenant. A bad id raises ValueError naming where it came from (-> 400 /
INVALID_ARGUMENT).
"""

from __future__ import annotations

from jbatch.engine.tenants import check_tenant

HTTP_HEADER = "X-Tenant-Id"
GRPC_METADATA_KEY = "x-tenant-id"


def pick_tenant(outer: str | None, outer_name: str, inner: str | None, inner_name: str) -> str:
    """The tenant from the transport key ``outer`` or else the request field ``inner``."""
    if outer is not None:
        return check_tenant(outer, outer_name)
    if inner:  # proto3 cannot tell an empty string from an absent field: both mean none
        return check_tenant(inner, inner_name)
    return check_tenant(None)


def http_tenant(headers, user: str | None) -> str:
    return pick_tenant(headers.get(HTTP_HEADER), HTTP_HEADER, user, "user")


def grpc_tenant(metadata, field: str) -> str:
    """``metadata``: the call's invocation metadata (pairs of key, value)."""
    outer = next((v for k, v in metadata or () if k.lower() == GRPC_METADATA_KEY), None)
    return pick_tenant(outer, GRPC_METADATA_KEY, field, "tenant")
