"""Serving errors: one status vocabulary, mapped onto gRPC codes and HTTP statuses."""

from __future__ import annotations

import enum

import grpc


class Status(enum.Enum):
    """Why a request failed; each member maps to one gRPC code and one HTTP status."""

    INVALID_ARGUMENT = (grpc.StatusCode.INVALID_ARGUMENT, 400)
    RESOURCE_EXHAUSTED = (grpc.StatusCode.RESOURCE_EXHAUSTED, 429)
    DEADLINE_EXCEEDED = (grpc.StatusCode.DEADLINE_EXCEEDED, 504)
    UNAVAILABLE = (grpc.StatusCode.UNAVAILABLE, 503)
    INTERNAL = (grpc.StatusCode.INTERNAL, 500)
    UNAUTHENTICATED = (grpc.StatusCode.UNAUTHENTICATED, 401)
    NOT_FOUND = (grpc.StatusCode.NOT_FOUND, 404)  # a resume that names no restored request
    TOO_LARGE = (grpc.StatusCode.RESOURCE_EXHAUSTED, 413)  # an HTTP body over max_body_bytes

    @property
    def grpc_code(self) -> grpc.StatusCode:
        return self.value[0]

    @property
    def http_status(self) -> int:
        return self.value[1]

    @property
    def label(self) -> str:
        """Lower-case name, used as a metrics label and as the OpenAI error ``type``."""
        return self.name.lower()


class ServingError(Exception):
    """A request failed with ``status``; ``message`` is safe to show the client."""

    def __init__(self, status: Status, message: str):
        super().__init__(message)
        self.status = status
        self.message = message

    def __repr__(self) -> str:
        return f"ServingError({self.status.name}, {self.message!r})"
