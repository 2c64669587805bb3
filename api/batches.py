"""OpenAI's Batch API on the job queue. Creating a batch checks every line of its input file with the same
validation as an interactive request: a bad line goes to the error file at once, the good ones are stored in the
batch's `lines` hash. From then on the batch is durable work in Redis: any API process's driver (a lease per
batch) submits its lines as jobs of the batch's tenant at the lowest priority (PRIORITY_MAX: the tenant's
interactive requests go first; other tenants are shielded by the fair queue), at most WINDOW at a time, and
records each line's result once (batch_result.lua) as the job ends. Every submit carries an idempotency key per
line, so a driver that dies between submitting and recording leaves nothing run twice.

A line's submit charges the tenant's batch_tpm bucket, never its interactive rpm and tpm (submit.lua's `batch`
budget); a line the budget refuses waits for a later tick. A key may hold max_open_batches batches not yet
ended and max_batch_lines lines in one (shared/tenants.py). A batch still running BATCH_WINDOW_S after it was
made (its completion_window, 24 h) expires: its running jobs are cancelled, and they and the lines never
submitted end in the error file as `batch_expired`.

A batch ends completed, failed (no line succeeded), expired or cancelled. One made with a `webhook_url` is then
announced on the `ended` stream (an entry with its `batch_id`) that the after-job drain reads: the drain POSTs
the event (workers/webhook.py), as it does a job's webhook, at least once."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from typing import Any

import orjson
import redis.asyncio as aredis
from pydantic import ValidationError
from redis.exceptions import RedisError

from api.errors import ApiError, too_many
from api.files import FileStore
from api.openai_schemas import ChatCompletionRequest, CompletionRequest
from api.responses import ResponseRequest, response_object
from api.store import JobStore
from api.validation import check_request
from shared import batch_ops, names, scripts
from shared.job_ops import NotCopied, execute_copied
from shared.jobs import BATCH_ENDS, TERMINAL, DamagedRecord, Job, JobStatus
from shared.limits import PRIORITY_MAX
from shared.schemas import GenerationRequest
from shared.settings import Settings
from shared.tenants import Tenant

log = logging.getLogger("conveyor.batches")

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/responses")
WINDOW = 64  # a batch's jobs in flight at once: twice an engine's slots, so a freed slot finds one waiting
LEASE_MS = 5000  # a driver that stops renewing (killed) hands the batch to another within this
TICK_S = 0.25
MAX_LINES = 50_000  # lines in one batch, whatever the key (a key's max_batch_lines may allow fewer)
STALE_OPEN_S = 3600  # a batch this long past its expiry no longer counts as open (a driver has ended it)


class LineError(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


def parse_line(raw: str, endpoint: str, settings: Settings) -> dict[str, Any]:
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
        gen = check_request(gen, settings)
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
    def __init__(self, client: aredis.Redis, store: JobStore, files: FileStore, settings: Settings) -> None:
        self.r, self.store, self.files, self.settings = client, store, files, settings
        self.token = uuid.uuid4().hex  # this process's lease token
        self._task: asyncio.Task[None] | None = None
        self._stopping = False

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
            good, total = await self._check_lines(meta, endpoint, pipe, lines_key, err_key, _max_lines(tenant))
        except BaseException:
            await self.r.delete(lines_key, err_key)  # nothing of a refused batch stays behind
            await self.r.zrem(names.batches_open(owner), batch_id)
            raise
        now = time.time()
        rec = {"id": batch_id, "owner": owner, "endpoint": endpoint, "input_file_id": input_file_id,
               "completion_window": "24h", "status": "in_progress", "created_at": now, "in_progress_at": now,
               "expires_at": now + window, "total": total, "completed": 0, "failed": total - good,
               "lines": good, "next": 0, "metadata": orjson.dumps(metadata).decode() if metadata else "",
               "webhook_url": webhook_url or ""}
        pipe.hset(names.batch_key(batch_id), mapping=rec)
        for key in (names.batch_key(batch_id), lines_key, err_key):
            pipe.expire(key, ttl)
        pipe.zadd(names.batches_index(owner), {batch_id: now})
        pipe.expire(names.batches_index(owner), ttl)
        pipe.sadd(names.BATCHES_ACTIVE, batch_id)
        written = [names.batch_key(batch_id), names.batches_index(owner), names.BATCHES_ACTIVE]
        if not (await execute_copied(self.r, pipe, written))[1]:
            # not promised, so not kept: a retry makes the batch anew, and this one must not run beside it
            await self.r.srem(names.BATCHES_ACTIVE, batch_id)
            await self.r.delete(names.batch_key(batch_id), lines_key, err_key)
            raise NotCopied(f"batch {batch_id}")
        return batch_object({k: str(v) for k, v in rec.items()})

    async def _open(self, tenant: Tenant, batch_id: str, ttl: int) -> None:
        """Count the batch among the tenant's open ones; 429 past its max_open_batches. Added first, then
        counted: two creates racing for the last place may both be refused, never both admitted."""
        key = names.batches_open(tenant.name)
        now = time.time()
        pipe = self.r.pipeline(transaction=False)
        pipe.zremrangebyscore(key, "-inf", now - STALE_OPEN_S)
        pipe.zadd(key, {batch_id: now + self.settings.batch_window_s})
        pipe.zcard(key)
        pipe.expire(key, ttl)
        _, _, n, _ = await pipe.execute()
        cap = tenant.max_open_batches
        if cap > 0 and n > cap:
            await self.r.zrem(key, batch_id)
            raise too_many(f"this key has {cap} batches not yet ended, its limit (max_open_batches); wait for "
                           "one to end, or cancel one", 60_000)

    async def _check_lines(self, meta: dict[str, Any], endpoint: str, pipe: Any, lines_key: str,
                           err_key: str, max_lines: tuple[int, str]) -> tuple[int, int]:
        """Check each line of the input file: good ones to `lines` (dense indexes), bad ones to `err`."""
        seen: set[str] = set()
        good, total = 0, 0
        limit, whose = max_lines
        async for raw in self.files.lines(meta):
            if not raw.strip():
                continue
            total += 1
            if total > limit:
                raise ApiError(400, f"a batch holds at most {limit} lines ({whose})", param="input_file_id",
                               code="too_many_lines")
            try:
                line = parse_line(raw, endpoint, self.settings)
                if line["custom_id"] in seen:
                    raise LineError("duplicate_custom_id", f"custom_id {line['custom_id']!r} appears twice")
                seen.add(line["custom_id"])
                pipe.hset(lines_key, good, orjson.dumps(line))
                good += 1
            except LineError as exc:
                pipe.hset(err_key, 1_000_000 + total,
                          orjson.dumps(_error(_custom_id(raw), exc.code, f"line {total}: {exc.message}")))
            if len(pipe) >= 500:
                await pipe.execute()
        return good, total

    async def get(self, batch_id: str, owner: str) -> dict[str, Any] | None:
        rec = await self.r.hgetall(names.batch_key(batch_id))
        if not rec or (rec.get("owner") or "") != owner:
            return None
        return rec

    async def cancel(self, batch_id: str, owner: str) -> dict[str, Any] | None:
        rec = await self.get(batch_id, owner)
        if rec is None:
            return None
        if rec["status"] in ("validating", "in_progress"):
            await self.r.hset(names.batch_key(batch_id), mapping={"status": "cancelling", "cancelling_at": time.time()})
            rec = await self.get(batch_id, owner) or rec
        return rec

    async def listing(self, owner: str, limit: int, after: str | None) -> tuple[list[dict[str, Any]], bool]:
        ids = await self.r.zrevrange(names.batches_index(owner), 0, -1)
        if after in ids:
            ids = ids[ids.index(after) + 1:]
        out = []
        for batch_id in ids[: limit + 1]:
            rec = await self.get(batch_id, owner)
            if rec is not None:
                out.append(batch_object(rec))
        return out[:limit], len(out) > limit

    # --- the driver ---------------------------------------------------------------------------------------

    def start(self) -> None:
        self._stopping = False
        self._task = asyncio.create_task(self._run(), name="batch-driver")

    async def stop(self) -> None:
        """End the driver. It also checks a flag between ticks: a cancellation that lands inside a Redis call can
        come out as that call's error (a timeout, a lost connection), which the loop survives by design; once
        the app's shutdown waited on such a driver forever."""
        self._stopping = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        while not self._stopping:
            try:
                for batch_id in await self.r.smembers(names.BATCHES_ACTIVE):
                    if await self._lease(batch_id):
                        await self.advance(batch_id)
            except (RedisError, OSError) as exc:
                log.warning("batch driver: %s", exc)
            except Exception:  # noqa: BLE001 - one batch's trouble must not stop the driver
                log.exception("batch driver step failed")
            await asyncio.sleep(TICK_S)

    async def _lease(self, batch_id: str) -> bool:
        key = names.batch_key(batch_id, "lease")
        if await self.r.set(key, self.token, nx=True, px=LEASE_MS):
            return True
        if await self.r.get(key) == self.token:
            await self.r.pexpire(key, LEASE_MS)
            return True
        return False

    async def advance(self, batch_id: str) -> None:
        """Record the lines whose jobs ended, submit more (or cancel the rest), finish when all are done; past
        its expiry, end what is left as expired."""
        rec = await self.r.hgetall(names.batch_key(batch_id))
        if rec and rec["status"] in BATCH_ENDS:  # ended, not yet announced: a driver stopped between the two
            await self._close(batch_id, rec)
            return
        if not rec or rec["status"] not in ("in_progress", "cancelling"):
            await self.r.srem(names.BATCHES_ACTIVE, batch_id)
            return
        expired = rec["status"] == "in_progress" and time.time() >= float(rec["expires_at"])
        inflight = list((await self.r.hgetall(names.batch_key(batch_id, "inflight"))).items())
        pipe = self.r.pipeline(transaction=False)  # each job's status alone, in one round trip
        for _, job_id in inflight:
            pipe.hget(names.job_key(job_id), "status")
        statuses = await pipe.execute() if inflight else []
        running = {}
        for (idx, job_id), status in zip(inflight, statuses):
            if status is not None and status not in TERMINAL:
                running[idx] = job_id
                continue
            try:
                job = await self.store.get(job_id) if status else None  # ended: its whole record, text and all
            except DamagedRecord:  # part of it lost (a failover): the line fails as for a job that is gone
                job = None
            line = orjson.loads(await self.r.hget(names.batch_key(batch_id, "lines"), idx) or "{}")
            await self._record(batch_id, idx, line, job, "batch_expired" if expired else "batch_cancelled")
        nxt, lines = int(rec["next"]), int(rec["lines"])
        expired = expired and bool(running or nxt < lines)  # every line done by then: it completed in time
        if rec["status"] == "cancelling" or expired:
            for job_id in running.values():
                await self.store.cancel(job_id, wait_s=0)
        if expired:
            await self._expire(batch_id, rec, list(running))
            return
        if rec["status"] == "cancelling":
            if not running:
                await self._finish(batch_id, rec, "cancelled")
            return
        cap = max(0, WINDOW - len(running))
        while cap > 0 and nxt < lines:
            line = orjson.loads(await self.r.hget(names.batch_key(batch_id, "lines"), nxt) or "{}")
            fields = {"batch": batch_id}
            if "response" in line:
                fields["response"] = line["response"]
            got = await self.store.submit(GenerationRequest.model_validate_json(line["request"]),
                                          f"{batch_id}:{nxt}", rec.get("owner") or "", 0, fields, budget="batch")
            if got.job is None:
                break  # refused for now (the key's batch_tpm, its unfinished jobs): the next tick tries again
            pipe = self.r.pipeline(transaction=False)
            pipe.hset(names.batch_key(batch_id, "inflight"), nxt, got.job.id)
            pipe.hset(names.batch_key(batch_id), "next", nxt + 1)
            pipe.expire(names.batch_key(batch_id, "inflight"), self.settings.job_ttl_s + self.settings.batch_window_s)
            await pipe.execute()
            running[str(nxt)] = got.job.id
            nxt, cap = nxt + 1, cap - 1
        if nxt >= lines and not running:
            completed = int(await self.r.hget(names.batch_key(batch_id), "completed") or 0)
            await self._finish(batch_id, rec, "completed" if completed else "failed")

    async def _record(self, batch_id: str, idx: str, line: dict[str, Any], job: Job | None,
                      cancelled_code: str = "batch_cancelled") -> None:
        custom = line.get("custom_id")
        ok = job is not None and job.status is JobStatus.succeeded
        if ok:
            assert job is not None
            result = {"id": f"batch_req_{job.id.removeprefix('job_')}", "custom_id": custom, "error": None,
                      "response": {"status_code": 200, "request_id": job.id, "body": _body(line, job)}}
        else:
            why = "the job expired" if job is None else (job.error or job.status.value)
            code = cancelled_code if job is not None and job.status is JobStatus.cancelled else "generation_failed"
            result = _error(custom, code, why)
        await batch_ops.record_result(self.r, batch_id, idx, orjson.dumps(result), ok)

    async def _expire(self, batch_id: str, rec: dict[str, Any], running: list[str]) -> None:
        """Past its window: the lines still running (their jobs cancelled just now) and those never submitted
        end in the error file as batch_expired (each once: a driver that stops midway leaves the rest to the
        next), and the batch ends expired."""
        left = [*running, *(str(i) for i in range(int(rec["next"]), int(rec["lines"])))]
        await scripts.aload(self.r)  # the calls below are pipelined, where a missing script is not loaded
        for at in range(0, len(left), 500):
            part = left[at:at + 500]
            lines = await self.r.hmget(names.batch_key(batch_id, "lines"), part)
            pipe = self.r.pipeline(transaction=False)
            for idx, raw in zip(part, lines):
                custom = orjson.loads(raw).get("custom_id") if raw else None
                result = _error(custom, "batch_expired", "the batch expired before this line ended")
                batch_ops.queue_result(pipe, batch_id, idx, orjson.dumps(result), False)
            await pipe.execute()
        await self._finish(batch_id, rec, "expired")

    async def _finish(self, batch_id: str, rec: dict[str, Any], status: str) -> None:
        """Make the results into the output and error files, end the batch as `status`, then announce it."""
        owner = rec.get("owner") or ""
        now = time.time()
        fields: dict[str, Any] = {"status": status, f"{status}_at": now, "finalizing_at": now}
        for part, suffix in (("out", "output"), ("err", "errors")):
            key = names.batch_key(batch_id, part)
            n = await self.r.hlen(key)
            if n:
                size = sum(len(v.encode()) + 1 for v in (await self.r.hvals(key)))
                f = await self.files.of_lines(f"file-{batch_id.removeprefix('batch_')}-{suffix}", owner,
                                              f"{batch_id}_{suffix}.jsonl", key, size)
                fields["output_file_id" if part == "out" else "error_file_id"] = f["id"]
        await self.r.hset(names.batch_key(batch_id), mapping=fields)
        await self._close(batch_id, {**rec, **fields})

    async def _close(self, batch_id: str, rec: dict[str, Any]) -> None:
        """An ended batch leaves the drivers' set and its key's open batches; one made with a webhook_url is
        first announced on the `ended` stream for the after-job drain. The entry goes before the mark that it
        went, so a driver that stops between the two announces it again: at least once."""
        owner = rec.get("owner") or ""
        if rec.get("webhook_url") and not rec.get("announced"):
            await self.r.xadd(names.stream(names.ENDED, names.batch_partition(owner)), {"batch_id": batch_id},
                              maxlen=names.ENDED_MAXLEN, approximate=True)
            await self.r.hset(names.batch_key(batch_id), "announced", 1)
        pipe = self.r.pipeline(transaction=False)
        pipe.zrem(names.batches_open(owner), batch_id)
        pipe.srem(names.BATCHES_ACTIVE, batch_id)
        await pipe.execute()


def _max_lines(tenant: Tenant | None) -> tuple[int, str]:
    """The most lines a batch of this caller may hold, and whose limit that is."""
    if tenant is not None and 0 < tenant.max_batch_lines < MAX_LINES:
        return tenant.max_batch_lines, "this key's max_batch_lines"
    return MAX_LINES, "the service's limit"


def _error(custom_id: str | None, code: str, message: str) -> dict[str, Any]:
    """A line of the error file."""
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id, "response": None,
            "error": {"code": code, "message": message}}


def _custom_id(raw: str) -> str | None:
    try:
        obj = orjson.loads(raw)
        return obj.get("custom_id") if isinstance(obj, dict) and isinstance(obj.get("custom_id"), str) else None
    except orjson.JSONDecodeError:
        return None


def _body(line: dict[str, Any], end: Job) -> dict[str, Any]:
    """The response body the line's endpoint would have answered."""
    if line.get("endpoint") == "/v1/responses":
        return response_object(end, orjson.loads(line["response"]))
    from api.routes.openai import Shape, usage_of

    chat = line.get("endpoint") == "/v1/chat/completions"
    shape = Shape(chat, bool(line.get("logprobs")), False, [None])
    out = {"id": ("chatcmpl-" if chat else "cmpl-") + end.id.removeprefix("job_"),
           "object": "chat.completion" if chat else "text_completion", "created": int(end.created_at),
           "model": end.model, "choices": [shape.choice(0, end)], "usage": usage_of([end], 1)}
    if chat:
        out["system_fingerprint"] = None
    return out
