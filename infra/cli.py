"""The `conveyor` command: run the stack or any one of its processes."""

from __future__ import annotations

import argparse
import logging
import os
import sys


def _logging() -> None:
    logging.basicConfig(level=os.environ.get("LOG_LEVEL", "INFO"),
                        format="%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="conveyor", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)

    up = sub.add_parser("up", help="start Redis (unless REDIS_URL is set), the API and the worker pools")
    up.add_argument("--tokenizers", type=int, default=1, help="tokenizer processes at start")
    up.add_argument("--inference", type=int, default=1, help="inference processes at start")
    up.add_argument("--no-autoscale", action="store_true", help="keep the pools at their start size")
    up.add_argument("--celery", type=int, default=1, choices=(0, 1),
                    help="run a Celery worker with beat for after-job work and upkeep (0: none)")

    sub.add_parser("api", help="run the HTTP API (uvicorn)")
    tok = sub.add_parser("tokenizer", help="run one tokenizer worker")
    tok.add_argument("--check", action="store_true", help="exit 0 if a live tokenizer worker is seen, else 1")
    inf = sub.add_parser("inference", help="run one inference worker")
    inf.add_argument("--check", action="store_true", help="exit 0 if a live inference worker is seen, else 1")
    sub.add_parser("redis", help="run the embedded redis-server in the foreground")

    model = sub.add_parser("model", help="manage the model cache")
    msub = model.add_subparsers(dest="model_cmd", required=True)
    msub.add_parser("pull", help="fetch and convert the configured model (idempotent)")
    msub.add_parser("path", help="print the local model path")

    args = parser.parse_args(argv)
    _logging()
    from shared.settings import get_settings

    settings = get_settings()

    if args.cmd == "model":
        from pathlib import Path

        from infra.model_pull import pull

        if args.model_cmd == "path":
            print(settings.model_path)
            return
        path = pull(settings.model, Path(settings.model_path))
        print(path)
    elif args.cmd == "up":
        from infra.supervisor import run_supervisor

        sys.exit(run_supervisor(settings, args.tokenizers, args.inference, autoscale=not args.no_autoscale,
                                celery=bool(args.celery)))
    elif args.cmd == "api":
        from api.server import serve

        serve(settings)
    elif args.cmd in ("tokenizer", "inference"):
        from shared.heartbeat import check_pool

        if args.check:
            sys.exit(0 if check_pool(settings, args.cmd) else 1)
        if args.cmd == "tokenizer":
            from workers.tokenizer.worker import main as tokenizer_main

            sys.exit(tokenizer_main(settings))
        from gpu_worker.worker import main as inference_main

        sys.exit(inference_main(settings))
    elif args.cmd == "redis":
        from infra.redis_server import run_foreground

        sys.exit(run_foreground(settings))


if __name__ == "__main__":
    main()
