"""Protocol definitions (``*.proto`` beside this file) and their Python modules, built at import time.

The stubs are generated from the .proto files by ``grpc.protos_and_services`` (grpcio-tools) on first use, so
the repository holds only the .proto sources and they can never drift from generated code.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path
from types import ModuleType

import grpc


_ROOT = str(Path(__file__).resolve().parents[2])
"""The folder holding the ``mooncake_jax`` package: the include root of the .proto files."""


@functools.cache
def load(name: str) -> tuple[ModuleType, ModuleType]:
    """``(messages, services)`` modules of ``mooncake_jax/proto/<name>.proto``.

    grpc_tools resolves .proto paths against ``sys.path``; an editable install does not put the source tree there
    (only an import hook), so the package root is added for the duration of the build.
    """
    added = _ROOT not in sys.path
    if added:
        sys.path.append(_ROOT)
    try:
        return grpc.protos_and_services(f"mooncake_jax/proto/{name}.proto")
    finally:
        if added:
            sys.path.remove(_ROOT)


UNANSWERED = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
"""Codes that mean the peer called did not answer (worth retrying, or probing whether it is alive), as opposed
to answering with a refusal."""

GRPC_MAX_MESSAGE_BYTES = 64 * 1024 * 1024
"""Message size limit set on every server and channel of the project; large payloads are still streamed in
pieces under gRPC's default 4 MiB cap (``transfer/pieces.py``), so foreign peers work too."""


def channel_options() -> list[tuple[str, int]]:
    """Options for servers and channels: raised message limits on both ends."""
    return [
        ("grpc.max_send_message_length", GRPC_MAX_MESSAGE_BYTES),
        ("grpc.max_receive_message_length", GRPC_MAX_MESSAGE_BYTES),
    ]


def server_options() -> list[tuple[str, int]]:
    """Options for servers: raised message limits, and no SO_REUSEPORT, so a second server on a taken port fails
    instead of silently sharing its calls."""
    return [*channel_options(), ("grpc.so_reuseport", 0)]
