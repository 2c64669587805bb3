"""OpenAI's Batch API on the job queue: creating, reading, cancelling and listing batches. Creating a batch
checks every line of its input file with the same validation as an interactive request: a bad line goes to the
error file at once, the good ones are stored in the batch's `lines` hash, each to run as a job of the batch's
tenant at the lowest priority (PRIORITY_MAX: the tenant's interactive requests go first; other tenants are
shielded by the fair queue). From then on the batch is durable work in Redis, which the batch driver in the
Celery worker advances (workers/batch_driver.py): it submits the lines, records their results, builds the output
and error files, expires and ends the batch and announces its end. A stack without a Celery worker
(`conveyor up --celery 0`) accepts batches and leaves them in progress.

A key may hold max_open_batches batches not yet ended and max_batch_lines lines in one (shared/tenants.py). A
batch expires BATCH_WINDOW_S after it was made (its completion_window, 24 h). Cancelling marks it `cancelling`;
the driver cancels its running jobs and ends it `cancelled`, keeping the lines that finished."""

from __future__ import annotations

import time
import uuid
from typing import Any, cast

import orjson
import redis.asyncio as aredis
from pydantic import ValidationError

from api.errors import ApiError, too_many
from api.files import FileStore
from api.models import resolve_static, runtime_adapters
from api.openai_schemas import ChatCompletionRequest, CompletionRequest
from api.responses import ResponseRequest
from api.validation import check_request
from shared import batch_ops, names, tracing
from shared.job_ops import NotCopied, Writes, execute_copied
from shared.limits import PRIORITY_MAX
from shared.lora import LoraModule
from shared.openai_bodies import line_error
from shared.settings import Settings
from shared.tenants import Tenant

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/responses")
MAX_LINES = 50_000  # lines in one batch, whatever the key (a key's max_batch_lines may allow fewer)
STALE_OPEN_S = 3600  # a batch this long past its expiry no longer counts as open (a driver has ended it)
CREATING_S = 600  # how long a batch being made (its lines checked) holds an open place and its lines' copy


class LineError(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


def parse_line(raw: str, endpoint: str, settings: Settings, tenant: Tenant | None = None,
               loaded: dict[str, LoraModule] | None = None) -> dict[str, Any]:
    """A line's custom_id and what its job runs; LineError when it is not a valid request for the endpoint."""
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise LineError("invalid_json", f"the line is not JSON: {exc}") from None
    if not isinstance(obj, dict) or not isinstance(obj.get("custom_id"), str) or not obj["custom_id"]:
        raise LineError("invalid_request", "a line needs a custom_id (a string)")
    if obj.get("method", "POST") != "POST" or obj.get("url") != endpoint:
        raise LineError("invalid_url", f"the line's method and url must be POST {endpoint}")
    body = obj.get("body")
    if not isinstance(body, dict):
        raise LineError("invalid_request", "the line's body must be an object")
    body = {**body, "stream": False}
    out: dict[str, Any] = {"custom_id": obj["custom_id"], "endpoint": endpoint}
    try:
        if endpoint == "/v1/responses":
            req = ResponseRequest(**body)
            req.check()
            if req.previous_response_id or req.background:
                raise ApiError(400, "previous_response_id and background are not for batch lines")
            conversation = req.input_messages()
            gen = req.generation(conversation)
            out["response"] = req.meta(conversation)
        else:
            oai = (ChatCompletionRequest if endpoint == "/v1/chat/completions" else CompletionRequest)(**body)
            gens = oai.to_generation()
            if len(gens) != 1 or oai.n != 1 or getattr(oai, "echo", False):
                raise ApiError(400, "a batch line runs one prompt, one choice, without echo")
            gen = gens[0]
            out["logprobs"] = oai.logprobs is not None and oai.logprobs is not False
        gen = check_request(resolve_static(settings, body.get("model"), tenant, loaded).apply(gen, settings),
                            settings)
    except ApiError as exc:
        raise LineError("invalid_request", exc.message) from None
    except ValidationError as exc:
        raise LineError("invalid_request", "; ".join(str(e.get("msg")) for e in exc.errors())) from None
    gen.priority = PRIORITY_MAX
    out["request"] = gen.model_dump_json(exclude_defaults=True)
    return out


def batch_object(rec: dict[str, Any]) -> dict[str, Any]:
    """OpenAI's Batch."""
    def at(name: str) -> int | None:
        v = rec.get(name)
        return int(float(v)) if v else None

    errors = None
    if rec["status"] == "failed":
        errors = {"object": "list", "data": [{"code": "no_line_succeeded", "line": None, "param": None,
                                              "message": "no line of the batch succeeded; see its error file"}]}
    return {"id": rec["id"], "object": "batch", "endpoint": rec["endpoint"], "errors": errors,
            "input_file_id": rec["input_file_id"], "completion_window": rec["completion_window"],
            "status": rec["status"], "output_file_id": rec.get("output_file_id") or None,
            "error_file_id": rec.get("error_file_id") or None, "created_at": at("created_at"),
            **{k: at(k) for k in ("in_progress_at", "expires_at", "finalizing_at", "completed_at", "failed_at",
                                  "expired_at", "cancelling_at", "cancelled_at")},
            "request_counts": {"total": int(rec.get("total") or 0), "completed": int(rec.get("completed") or 0),
                               "failed": int(rec.get("failed") or 0)},
            "metadata": orjson.loads(rec.get("metadata") or "null")}


class Batches:
    def __init__(self, client: aredis.Redis, files: FileStore, settings: Settings) -> None:
        self.r, self.files, self.settings = client, files, settings  # a decoding client: replies are text

    async def create(self, tenant: Tenant | None, input_file_id: str, endpoint: str,
                     metadata: dict[str, str] | None, webhook_url: str | None = None) -> dict[str, Any]:
        """Check the input file's lines and start the batch; `tenant` None is the caller without a key (AUTH off:
        only MAX_LINES bounds it)."""
        owner = tenant.name if tenant else ""
        if endpoint not in ENDPOINTS:
            raise ApiError(400, f"endpoint must be one of {', '.join(ENDPOINTS)}", param="endpoint")
        meta = await self.files.meta(input_file_id, owner)
        if meta is None or meta["purpose"] != "batch":
            raise ApiError(404, f"no batch input file with id '{input_file_id}'", param="input_file_id")
        batch_id = "batch_" + uuid.uuid4().hex
        lines_key, err_key = names.batch_key(batch_id, "lines"), names.batch_key(batch_id, "err")
        window = self.settings.batch_window_s
        ttl = self.settings.job_ttl_s + window
        if tenant is not None:
            await self._open(tenant, batch_id, ttl)
        pipe = self.r.pipeline(transaction=False)
        try:
            good, total = await self._check_lines(meta, endpoint, pipe, (lines_key, err_key), _max_lines(tenant),
                                                  tenant)
            if not total:  # (a batch of nothing would end `failed` at once, pointing at an error file it has not)
                raise ApiError(400, "the input file holds no request: it is empty or has blank lines only",
                               param="input_file_id", code="empty_file")
        except BaseException:
            await self.r.delete(lines_key, err_key)  # nothing of a refused batch stays behind
            await self.r.zrem(names.batches_open(owner), batch_id)
            raise
        now = time.time()
        rec: dict[str, str | float]
        rec = {"id": batch_id, "owner": owner, "endpoint": endpoint, "input_file_id": input_file_id,
               "completion_window": "24h", "status": "in_progress", "created_at": now, "in_progress_at": now,
               "expires_at": now + window, "total": total, "completed": 0, "failed": total - good,
               "lines": good, "next": 0, "metadata": orjson.dumps(metadata).decode() if metadata else "",
               "webhook_url": webhook_url or "", "trace": tracing.carrier()}  # its lines' jobs join its trace
        await pipe.execute()  # its last lines (the record's promise covers them: a replica receives writes in order)
        writes = Writes()
        # redis-py types `mapping` as Mapping[FieldT, ...], whose key (a union) is invariant: no dict[str, ...] fits
        writes.hset(names.batch_key(batch_id), mapping=rec)  # type: ignore[arg-type]
        for key in (names.batch_key(batch_id), lines_key, err_key):
            writes.expire(key, ttl)
        writes.zadd(names.batches_index(owner), {batch_id: now})
        if tenant is not None:
            writes.zadd(names.batches_open(owner), {batch_id: now + window})  # open until it ends (the driver's)
        writes.zremrangebyscore(names.batches_index(owner), 0, now - ttl)  # expired batches leave the index
        writes.expire(names.batches_index(owner), ttl)
        copied = False
        try:  # the record first, then the driver's set: a driver that finds the id finds its record
            copied = (await execute_copied(self.r, writes))[1]
            if copied:
                active = Writes()
                active.sadd(names.BATCHES_ACTIVE, batch_id)
                copied = (await execute_copied(self.r, active))[1]
        finally:
            if not copied:
                # not promised, so not kept: a retry makes the batch anew, this one must not run beside it, and it
                # is no longer among its tenant's open batches
                await self.r.srem(names.BATCHES_ACTIVE, batch_id)
                await self.r.delete(names.batch_key(batch_id), lines_key, err_key)
                await self.r.zrem(names.batches_open(owner), batch_id)
        if not copied:
            raise NotCopied(f"batch {batch_id}")
        return batch_object({k: str(v) for k, v in rec.items()})

    async def _open(self, tenant: Tenant, batch_id: str, ttl: int) -> None:
        """Count the batch among the tenant's open ones; 429 past its max_open_batches. Added first, then
        counted: two creates racing for the last place may both be refused, never both admitted."""
        key = names.batches_open(tenant.name)
        now = time.time()
        pipe = self.r.pipeline(transaction=False)
        pipe.zremrangebyscore(key, "-inf", now - STALE_OPEN_S)
        pipe.zadd(key, {batch_id: now + CREATING_S})  # its window once made: an API killed meanwhile holds it briefly
        pipe.zcard(key)
        pipe.expire(key, ttl)
        _, _, n, _ = await pipe.execute()
        cap = tenant.max_open_batches
        if cap > 0 and n > cap:
            await self.r.zrem(key, batch_id)
            raise too_many(f"this key has {cap} batches not yet ended, its limit (max_open_batches); wait for "
                           "one to end, or cancel one", 60_000)

    async def _check_lines(self, meta: dict[str, Any], endpoint: str, pipe: Any, keys: tuple[str, str],
                           max_lines: tuple[int, str], tenant: Tenant | None) -> tuple[int, int]:
        """Check each line of the input file: good ones to `lines` (dense indexes), bad ones to `err` (`keys`), each
        flush with an expiry of CREATING_S (the record's write gives them the batch's): an API killed meanwhile
        leaves nothing for long."""
        lines_key, err_key = keys
        seen: set[str] = set()
        good, total = 0, 0
        limit, whose = max_lines
        loaded = await runtime_adapters(self.r)  # a line may name an adapter loaded at run time, as a request may
        number = 0  # the line's number in the file, blank lines counted (as an editor shows it)
        async for raw in self.files.lines(meta):
            number += 1
            if number == 1:
                raw = raw.removeprefix("\ufeff")  # a byte-order mark, as Windows tools write
            if not raw.strip():
                continue
            total += 1
            if total > limit:
                raise ApiError(400, f"a batch holds at most {limit} lines ({whose})", param="input_file_id",
                               code="too_many_lines")
            try:
                line = parse_line(raw, endpoint, self.settings, tenant, loaded)
                if line["custom_id"] in seen:
                    raise LineError("duplicate_custom_id", f"custom_id {line['custom_id']!r} appears twice")
                seen.add(line["custom_id"])
                pipe.hset(lines_key, good, orjson.dumps(line))
                good += 1
            except LineError as exc:
                pipe.hset(err_key, 1_000_000 + total,
                          orjson.dumps(line_error(_custom_id(raw), exc.code, f"line {number}: {exc.message}")))
            if len(pipe) >= 500:
                _expire(pipe, keys, CREATING_S)
                await pipe.execute()
        _expire(pipe, keys, CREATING_S)
        return good, total

    async def get(self, batch_id: str, owner: str) -> dict[str, Any] | None:
        rec = cast("dict[str, str]", await self.r.hgetall(names.batch_key(batch_id)))
        if not rec or (rec.get("owner") or "") != owner:
            return None
        return rec

    async def cancel(self, batch_id: str, owner: str) -> dict[str, Any] | None:
        rec = await self.get(batch_id, owner)
        if rec is None:
            return None
        if rec["status"] in ("validating", "in_progress") and await batch_ops.request_cancel(self.r, batch_id,
                                                                                              time.time()):
            rec = await self.get(batch_id, owner) or rec  # (its driver cancels it; one that just ended stays so)
        return rec

    async def listing(self, owner: str, limit: int, after: str | None) -> tuple[list[dict[str, Any]], bool]:
        ids = cast("list[str]", await self.r.zrevrange(names.batches_index(owner), 0, -1))
        if after in ids:
            ids = ids[ids.index(after) + 1:]
        out = []
        for batch_id in ids:  # (a batch whose record expired is skipped: the page still fills)
            rec = await self.get(batch_id, owner)
            if rec is not None:
                out.append(batch_object(rec))
            if len(out) > limit:
                break
        return out[:limit], len(out) > limit


def _expire(pipe: Any, keys: tuple[str, ...], ttl: int) -> None:
    for key in keys:
        pipe.expire(key, ttl)


def _max_lines(tenant: Tenant | None) -> tuple[int, str]:
    """The most lines a batch of this caller may hold, and whose limit that is."""
    if tenant is not None and 0 < tenant.max_batch_lines < MAX_LINES:
        return tenant.max_batch_lines, "this key's max_batch_lines"
    return MAX_LINES, "the service's limit"


def _custom_id(raw: str) -> str | None:
    try:
        obj = orjson.loads(raw)
        return obj.get("custom_id") if isinstance(obj, dict) and isinstance(obj.get("custom_id"), str) else None
    except orjson.JSONDecodeError:
        return None
