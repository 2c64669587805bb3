"""Runs the API under uvicorn. On SIGTERM/SIGINT open event streams end at once (sse-starlette sees
uvicorn's exit flag; their clients resume elsewhere with Last-Event-ID) instead of holding the
shutdown until their jobs finish."""

from __future__ import annotations

import socket
from types import FrameType

import uvicorn

from api import sse
from shared.settings import Settings


class Server(uvicorn.Server):
    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        sse.begin_shutdown()  # open streams end now (their clients resume elsewhere), not at their jobs' end
        super().handle_exit(sig, frame)


def serve(settings: Settings) -> None:
    """PORT serves clients; when keys are required, INTERNAL_PORT (default PORT + 1) on INTERNAL_HOST (loopback
    by default: it asks no key) also serves the operator's pages (/metrics, /scaling, /docs), which PORT then
    refuses."""
    config = uvicorn.Config("api.main:app", host=settings.host, port=settings.port, log_level="warning",
                            loop="uvloop", http="httptools", lifespan="on")
    sockets = None
    if settings.auth_required:
        sockets = [_bind(settings.host, settings.port), _bind(settings.internal_host, settings.internal_port_number)]
    Server(config).run(sockets=sockets)


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host.strip("[]"), port))
    sock.set_inheritable(True)
    return sock
