"""Runs the API under uvicorn. On SIGTERM/SIGINT open event streams end at once (their clients
resume elsewhere with Last-Event-ID) instead of holding the shutdown until their jobs finish."""

from __future__ import annotations

from types import FrameType

import uvicorn

from api import sse
from shared.settings import Settings


class Server(uvicorn.Server):
    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        sse.close_all()
        super().handle_exit(sig, frame)


def serve(settings: Settings) -> None:
    config = uvicorn.Config("api.main:app", host=settings.host, port=settings.port, log_level="warning",
                            loop="uvloop", http="httptools", lifespan="on")
    Server(config).run()
