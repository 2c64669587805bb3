"""The Lua scripts of the Redis protocol, one `.lua` file each beside this module (each opens with its
KEYS, ARGV and reply), and how they are called. Their replies' types (codes and parsed fields) are in
`shared.scripts.codes`; each script's keys and arguments are built, and its calls made, by one function of
the module of its noun: shared/job_ops.py (a job's), shared/fair_queue.py, shared/batch_ops.py and
shared/file_ops.py. Every key a script touches is one of its KEYS (docs/redis-keys.md).

A call sends EVALSHA; a NOSCRIPT answer (a Redis that restarted or flushed its script cache) loads
every script and sends the call again. In a pipeline a call is queued as EVALSHA too, and `execute`
runs the pipeline and replays, in order, the commands that answered NOSCRIPT once the scripts are
loaded (the pipelines of `shared.redis_client` clients do so on their own). Nothing here sends
SCRIPT EXISTS, which redis-py's `register_script` sends before every pipeline that holds one.

On a Redis Cluster a call is sent as EVAL with the script's source: a replica promoted by a
failover has an empty script cache, and EVAL needs none (Redis compiles a source once and keeps it).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import redis
import redis.asyncio as aredis
import redis.asyncio.cluster as acluster
import redis.cluster
from redis.exceptions import NoScriptError, ResponseError

from shared.redis_errors import refused

_CLUSTER = (redis.cluster.RedisCluster, acluster.RedisCluster, acluster.ClusterPipeline)

HERE = Path(__file__).resolve().parent


class Script:
    def __init__(self, name: str) -> None:
        self.name = name
        self.source = (HERE / f"{name}.lua").read_text(encoding="utf-8")
        self.sha = hashlib.sha1(self.source.encode()).hexdigest()

    def __call__(self, client: redis.Redis, keys: list[Any], args: list[Any]) -> Any:
        try:
            if isinstance(client, _CLUSTER):
                return client.eval(self.source, len(keys), *keys, *args)
            try:
                return client.evalsha(self.sha, len(keys), *keys, *args)
            except NoScriptError:
                load(client)
                return client.evalsha(self.sha, len(keys), *keys, *args)
        except ResponseError as exc:
            raise refused(exc) from None

    async def acall(self, client: aredis.Redis, keys: list[Any], args: list[Any]) -> Any:
        try:
            if isinstance(client, _CLUSTER):
                return await client.eval(self.source, len(keys), *keys, *args)
            try:
                return await client.evalsha(self.sha, len(keys), *keys, *args)
            except NoScriptError:
                await aload(client)
                return await client.evalsha(self.sha, len(keys), *keys, *args)
        except ResponseError as exc:
            raise refused(exc) from None

    def queue(self, pipe: redis.client.Pipeline, keys: list[Any], args: list[Any]) -> Any:
        """Queue the call on `pipe`, to be run by `execute` (or a pipeline of a shared.redis_client client)."""
        if isinstance(pipe, _CLUSTER):  # (a cluster's pipeline refuses .eval(): it cannot see the slots)
            return pipe.execute_command("EVAL", self.source, len(keys), *keys, *args)
        return pipe.evalsha(self.sha, len(keys), *keys, *args)


START = Script("start")
STEP = Script("step")
FINISH = Script("finish")
SUBMIT = Script("submit")
REQUEST_CANCEL = Script("request_cancel")
ACCOUNT = Script("account")
NOTE_FAILURE = Script("note_failure")
COUNT_AFTER = Script("count_after")
STREAM_OPEN = Script("stream_open")
TAIL = Script("tail")
FAIR_PUSH = Script("fair_push")
FAIR_POP = Script("fair_pop")
BATCH_RESULT = Script("batch_result")
FILE_BYTES = Script("file_bytes")
BATCH_CANCEL = Script("batch_cancel")
PRUNE_CONSUMERS = Script("prune_consumers")
TAKE_REQUEST = Script("take_request")
ALL = (START, STEP, FINISH, SUBMIT, REQUEST_CANCEL, ACCOUNT, NOTE_FAILURE, COUNT_AFTER, STREAM_OPEN, TAIL, FAIR_PUSH,
       FAIR_POP, BATCH_RESULT, FILE_BYTES, BATCH_CANCEL, PRUNE_CONSUMERS, TAKE_REQUEST)


def load(client: redis.Redis | redis.client.Pipeline) -> None:
    """Load every script (one round trip) on the client's (or pipeline's) connection pool; nothing
    on a cluster, where calls carry their source."""
    if isinstance(client, _CLUSTER):
        return
    pipe = redis.client.Pipeline(client.connection_pool, client.response_callbacks, False, None)
    for script in ALL:
        pipe.script_load(script.source)
    pipe.execute()


async def aload(client: aredis.Redis) -> None:
    if isinstance(client, _CLUSTER):
        return
    pipe = client.pipeline(transaction=False)
    for script in ALL:
        pipe.script_load(script.source)
    await pipe.execute()


def execute(pipe: redis.client.Pipeline, raise_on_error: bool = True) -> list[Any]:
    """Run `pipe`. Commands that answered NOSCRIPT ran nothing: once every script is loaded they run
    again, in their order, in one more round trip (a transaction's again as one transaction)."""
    if isinstance(pipe, _CLUSTER):  # its calls carry their source: nothing to replay
        results = [refused(res) if isinstance(res, ResponseError) else res
                   for res in pipe.execute(raise_on_error=False)]
        _raise_first(results, raise_on_error)
        return results
    stack = list(pipe.command_stack)
    results = redis.client.Pipeline.execute(pipe, raise_on_error=False)
    missing = [i for i, res in enumerate(results) if isinstance(res, NoScriptError)]
    if missing:
        load(pipe)
        for i in missing:
            args, options = stack[i]
            pipe.pipeline_execute_command(*args, **options)
        for i, res in zip(missing, redis.client.Pipeline.execute(pipe, raise_on_error=False)):
            results[i] = res
    results = [refused(res) if isinstance(res, ResponseError) else res for res in results]
    _raise_first(results, raise_on_error)
    return results


def _raise_first(results: list[Any], raise_on_error: bool) -> None:
    if raise_on_error:
        for res in results:
            if isinstance(res, Exception):
                raise res


class Pipeline(redis.client.Pipeline):
    """A pipeline whose `execute` is `execute` above."""

    def execute(self, raise_on_error: bool = True) -> list[Any]:
        return execute(self, raise_on_error)
