"""The Batch API's driver (OpenAI's Batch API; api/batches.py creates a batch, checks its lines and stores the
good ones in its `lines` hash). A batch is durable work in Redis: a driver holds a lease per batch (LEASE_MS,
renewed each tick and within a long step), so any number of them may run, in any Celery worker, and one that is
killed hands its batches over within LEASE_MS. Each tick, for each batch it holds, the driver records the lines
whose jobs ended (once each: batch_result.lua), submits more as jobs of the batch's tenant (at most WINDOW in flight, at
the priority the line was stored with, PRIORITY_MAX), cancels the rest of a batch being cancelled (a line whose
job has not stopped CANCEL_WAIT_S after the cancel ends as batch_cancelled, as do the lines never submitted), and
ends a batch once every line is done.

Every submit carries an idempotency key per line (`{batch_id}:{n}`), so a driver that dies between submitting
and noting the job leaves nothing to run twice: the next one's submit finds the same job. A line's submit
charges the tenant's batch_tpm bucket, never its interactive rpm and tpm (submit.lua's `batch` budget); a line
the budget refuses waits for a later tick. A job whose record is damaged (shared.jobs.DamagedRecord, a
failover's leftover) fails its line, as one that expired does; the batch goes on.

A batch still running past its `expires_at` expires: its running jobs are cancelled, and they and the lines
never submitted end in the error file as `batch_expired`. An ended batch's results become its output and
error files (the files API reads them as hashes of lines, api/files.py), and one made with a `webhook_url` is
announced on the `ended` stream, which the after-job drain reads (workers/after_job.py): at least once.

The driver runs in the Celery worker, beside the after-job drain (workers/celery_app.py says how)."""

from __future__ import annotations

import logging
import threading
import time
import uuid
from typing import Any, cast

import orjson
import redis
from redis.exceptions import RedisError

from shared import batch_ops, file_ops, names, scripts
from shared.fence import Fence
from shared.file_ops import file_bytes_write
from shared.job_ops import (
    JobOps,
    NotCopied,
    Write,
    new_job,
    promise,
    request_cancel_write,
    submit_write,
)
from shared.jobs import BATCH_ENDS, DamagedRecord, FinishReason, Job, JobStatus
from shared.openai_bodies import line_body, line_error, line_result
from shared.redis_client import CLUSTER_TYPES
from shared.ring import channel_of
from shared.schemas import GenerationRequest
from shared.scripts.codes import FinishCode, SubmitCode, SubmitReply
from shared.settings import Settings

log = logging.getLogger("conveyor.batch_driver")

WINDOW = 64  # a batch's jobs in flight at once: twice an engine's slots, so a freed slot finds one waiting
LEASE_MS = 5000  # a driver that stops renewing (killed) hands the batch to another within this
TICK_S = 0.25
CANCEL_WAIT_S = 600  # a cancelled batch waits this long for its running lines' jobs to stop (OpenAI: "up to 10 min")
ACTIVE = frozenset({JobStatus.queued.value, JobStatus.running.value})


class KeyRevoked(Exception):
    """The batch's key was revoked (or its tenant deleted): its lines are refused for good."""


class LeaseLost(Exception):
    """Another driver holds the batch now (this one's lease ran out mid-step): this one's step stops."""


class BatchDriver:
    """Advances the batches whose lease it holds; `token` names its leases (one per driver)."""

    def __init__(self, client: redis.Redis, settings: Settings, token: str = "") -> None:
        self.r, self.settings = client, settings  # a client that decodes responses
        self.token = token or uuid.uuid4().hex
        self.jobs = JobOps(client, settings.job_ttl_s)
        self.ttl_s = settings.job_ttl_s + settings.batch_window_s  # a batch's keys and files
        self.jobs_maxlen = 4 * settings.max_queued + 10_000  # as the API's submits (api/store.py)
        self.cluster = isinstance(client, CLUSTER_TYPES)
        self.fence = Fence(client) if self.cluster else None  # type: ignore[arg-type]

    def run(self, stop: threading.Event) -> int:
        """Tick every TICK_S until `stop` is set; the ticks run."""
        ticks = 0
        while not stop.is_set():
            self.tick()
            ticks += 1
            stop.wait(TICK_S)
        return ticks

    def tick(self) -> int:
        """Advance every active batch this driver holds (or now takes) the lease of; how many it advanced.
        Nothing in one batch stops the others, and an outage waits for the next tick."""
        try:
            active = sorted(cast("set[str]", self.r.smembers(names.BATCHES_ACTIVE)))
        except (RedisError, OSError) as exc:
            log.warning("batch driver: %s", exc)
            return 0
        advanced = 0
        for batch_id in active:
            try:
                if self._lease(batch_id):
                    self.advance(batch_id)
                    advanced += 1
            except (RedisError, OSError) as exc:
                log.warning("batch driver, %s: %s", batch_id, exc)
            except LeaseLost:
                log.warning("batch driver, %s: another driver took the batch over mid-step", batch_id)
            except Exception:  # noqa: BLE001 - one batch's trouble must not stop the driver
                log.exception("batch driver, %s: the step failed", batch_id)
        return advanced

    def _lease(self, batch_id: str) -> bool:
        key = names.batch_key(batch_id, "lease")
        if self.r.set(key, self.token, nx=True, px=LEASE_MS):
            return True
        if self.r.get(key) == self.token:
            self.r.pexpire(key, LEASE_MS)
            return True
        return False

    def _hold(self, batch_id: str) -> None:
        """Renew this driver's lease within a long step; LeaseLost (the step stops) when another driver holds it."""
        if not self._lease(batch_id):
            raise LeaseLost(batch_id)

    def release(self) -> None:
        """Give up this driver's leases (a warm shutdown), so that another driver takes its batches over at its
        next tick rather than after LEASE_MS."""
        for batch_id in cast("set[str]", self.r.smembers(names.BATCHES_ACTIVE)):
            key = names.batch_key(batch_id, "lease")
            if self.r.get(key) == self.token:
                self.r.delete(key)

    def advance(self, batch_id: str) -> None:
        """Record the lines whose jobs ended, submit more (or cancel the rest), finish when all are done; past
        its expiry, end what is left as expired."""
        rec = cast("dict[str, str]", self.r.hgetall(names.batch_key(batch_id)))  # (a decoding client: text)
        if rec and rec["status"] in BATCH_ENDS:  # ended, not yet announced: a driver stopped between the two
            self._close(batch_id, rec)
            return
        if not rec or rec["status"] not in ("in_progress", "cancelling"):
            self.r.srem(names.BATCHES_ACTIVE, batch_id)
            return
        expired = rec["status"] == "in_progress" and time.time() >= float(rec["expires_at"])
        running = self._collect(batch_id, "batch_expired" if expired else "batch_cancelled")
        nxt, lines = int(rec["next"]), int(rec["lines"])
        expired = expired and bool(running or nxt < lines)  # every line done by then: it completed in time
        if rec["status"] == "cancelling" or expired:
            for job_id in running.values():
                self._cancel(job_id)
        if expired:
            self._expire(batch_id, rec, list(running))
        elif rec["status"] == "cancelling":
            if running and time.time() >= float(rec.get("cancelling_at") or 0) + CANCEL_WAIT_S:
                self._give_up(batch_id, running)  # jobs no engine stops (theirs died, none of their model runs)
                running = {}
            if not running:  # the lines never submitted end in the error file too: every line is in a file
                self._end_lines(batch_id, [str(i) for i in range(nxt, lines)], "batch_cancelled",
                                "the batch was cancelled before this line was run")
                self._finish(batch_id, rec, "cancelled")
        elif self._submit_more(batch_id, rec, running) >= lines and not running:
            completed = int(self.r.hget(names.batch_key(batch_id), "completed") or 0)
            self._finish(batch_id, rec, "completed" if completed else "failed")

    def _collect(self, batch_id: str, cancelled_code: str) -> dict[str, str]:
        """Record the result of every line in flight whose job ended (or is gone); the rest, index -> job id."""
        inflight = list(cast("dict[str, str]", self.r.hgetall(names.batch_key(batch_id, "inflight"))).items())
        pipe = self.r.pipeline(transaction=False)  # each job's status alone, in one round trip
        for _, job_id in inflight:
            pipe.hget(names.job_key(job_id), "status")
        statuses = pipe.execute() if inflight else []
        running = {}
        for (idx, job_id), status in zip(inflight, statuses):
            if status in ACTIVE:
                running[idx] = job_id
                continue
            line = orjson.loads(self.r.hget(names.batch_key(batch_id, "lines"), idx) or "{}")
            why = "the job expired"
            try:
                job = self._job(job_id) if status else None
            except DamagedRecord as exc:  # part of it lost (a failover): the line fails, the batch goes on
                job, why = None, f"the job's record is incomplete ({exc.problem})"
            self._record(batch_id, idx, line, job, why, cancelled_code)
        return running

    def _job(self, job_id: str) -> Job | None:
        """The job's whole record, text and logprobs too (as the API reads it), or None when it is gone."""
        pipe = self.r.pipeline(transaction=False)
        pipe.hgetall(names.job_key(job_id))
        for key in (names.text_key(job_id), names.logprobs_key(job_id), names.prompt_logprobs_key(job_id)):
            pipe.get(key)
        rec, text, logprobs, prompt_logprobs = pipe.execute()
        if not rec:
            return None
        return Job.from_record({**rec, "text": text or "", "logprobs": logprobs or "",
                                "prompt_logprobs": prompt_logprobs or ""}, job_id)

    def _record(self, batch_id: str, idx: str, line: dict[str, Any], job: Job | None, gone: str,
                cancelled_code: str) -> None:
        """A line's result, once: its body when its job succeeded, else why not (`gone`: the job is)."""
        custom = line.get("custom_id")
        ok = job is not None and job.status is JobStatus.succeeded
        if job is not None and ok:
            result = line_result(custom, job, line_body(line, job))
        elif job is None:
            result = line_error(custom, "generation_failed", gone)
        else:
            code = cancelled_code if job.status is JobStatus.cancelled else "generation_failed"
            result = line_error(custom, code, job.error or job.status.value)
        scripts.BATCH_RESULT(self.r, *batch_ops.result_write(batch_id, idx, orjson.dumps(result), ok))

    def _submit_more(self, batch_id: str, rec: dict[str, str], running: dict[str, str]) -> int:
        """Submit lines until WINDOW are in flight or the budget refuses one; the next line's index after."""
        nxt, lines = int(rec["next"]), int(rec["lines"])
        cap = max(0, WINDOW - len(running))
        while cap > 0 and nxt < lines:
            raw = self.r.hget(names.batch_key(batch_id, "lines"), nxt)
            line = orjson.loads(raw) if raw else {}
            try:
                job_id = self._submit(line, f"{batch_id}:{nxt}", rec.get("owner") or "", batch_id,
                                      rec.get("trace") or "") if raw else None
            except KeyRevoked:  # its key was revoked: no line of it will be taken again; it ends as cancelled
                log.warning("batch %s: its key was revoked; the batch is cancelled", batch_id)
                scripts.BATCH_CANCEL(self.r, *batch_ops.cancel_write(batch_id, time.time()))
                break
            if raw and job_id is None:
                break  # refused for now (the key's batch_tpm, its unfinished jobs): the next tick tries again
            pipe = self.r.pipeline(transaction=True)  # one slot: the line in flight and `next` land together
            if job_id is not None:
                pipe.hset(names.batch_key(batch_id, "inflight"), nxt, job_id)
                pipe.expire(names.batch_key(batch_id, "inflight"), self.ttl_s)
                running[str(nxt)] = job_id
            pipe.hset(names.batch_key(batch_id), "next", nxt + 1)
            pipe.execute()
            if job_id is None:  # the line itself is gone (its keys expired): it fails, the rest go on
                self._record(batch_id, str(nxt), {}, None, "the batch's line expired", "batch_cancelled")
            nxt, cap = nxt + 1, cap - 1
        return nxt

    def _submit(self, line: dict[str, Any], idempotency_key: str, owner: str, batch_id: str,
                trace: str = "") -> str | None:
        """Submit a line's job on the tenant's batch budget, as the API's submit stores a job (api/store.py):
        its id (that of the job its idempotency key already names, on a replay), None when refused. `trace`:
        the batch's trace carrier, which the line's job joins ('' none)."""
        req = GenerationRequest.model_validate_json(line["request"])
        fields = {"batch": batch_id}
        if "response" in line:
            fields["response"] = line["response"]  # what the Responses API keeps with its job (api/responses.py)
        model = req.model or req.base_model or self.settings.default_model  # the name the line asked for
        job_id, record, request_json = new_job(req, model, self.settings.tool_call_parser,
                                               owner, idempotency_key, fields, trace)
        write = submit_write(job_id, record, request_json, self.settings.job_ttl_s, owner=owner,
                             reserve_tokens=req.reserved_tokens(), idempotency_key=idempotency_key,
                             idempotency_ttl_s=self.settings.idempotency_ttl_s, jobs_maxlen=self.jobs_maxlen,
                             budget="batch")
        reply = SubmitReply.parse(self._promised(scripts.SUBMIT, write, f"job {job_id} of {idempotency_key}"))
        if reply.code is SubmitCode.replay:
            return reply.job_id or None
        if reply.code is SubmitCode.unknown_tenant:
            raise KeyRevoked(owner)
        return job_id if reply.code is SubmitCode.accepted else None

    def _promised(self, script: scripts.Script, write: Write, what: str) -> Any:
        """A script call whose writes must outlive a failover: on a cluster a replica must have them (WAIT 1 on
        the same connection), else NotCopied, and the tick tries again (the same idempotency key: the same
        job). A single Redis fsyncs before it answers."""
        if not self.cluster:
            return script(self.r, *write)
        reply, copied = promise(self.r, script, write, what)  # type: ignore[arg-type]
        if not copied:
            raise NotCopied(what)
        return reply

    def _cancel(self, job_id: str) -> None:
        """End a queued job now; ask the engine running one to stop it (its end comes at its next step)."""
        ended = self.jobs.finish(job_id, FinishReason.cancelled, required_status=JobStatus.queued.value)
        if ended is None or ended.code is not FinishCode.finished:
            scripts.REQUEST_CANCEL(self.r, *request_cancel_write(job_id))

    def _give_up(self, batch_id: str, running: dict[str, str]) -> None:
        """A cancelled batch's lines whose jobs did not end within CANCEL_WAIT_S end in the error file as
        batch_cancelled (each once); their cancels stay requested."""
        lines = self.r.hmget(names.batch_key(batch_id, "lines"), list(running))
        pipe = self.r.pipeline(transaction=False)
        for idx, raw in zip(running, lines):
            custom = orjson.loads(raw).get("custom_id") if raw else None
            result = line_error(custom, "batch_cancelled", "the batch was cancelled and this line's job did not "
                                f"stop within {CANCEL_WAIT_S} s")
            batch_ops.queue_result(pipe, batch_id, idx, orjson.dumps(result), False)
        scripts.execute(pipe)

    def _expire(self, batch_id: str, rec: dict[str, str], running: list[str]) -> None:
        """Past its window: the lines still running (their jobs cancelled just now) and those never submitted
        end in the error file as batch_expired (each once: a driver that stops midway leaves the rest to the
        next), and the batch ends expired."""
        left = [*running, *(str(i) for i in range(int(rec["next"]), int(rec["lines"])))]
        self._end_lines(batch_id, left, "batch_expired", "the batch expired before this line ended")
        self._finish(batch_id, rec, "expired")

    def _end_lines(self, batch_id: str, idxs: list[str], code: str, message: str) -> None:
        """These lines end in the error file with `code` (each once: a driver that stops midway leaves the rest to
        the next)."""
        for at in range(0, len(idxs), 500):
            self._hold(batch_id)  # a big batch's end takes seconds (~10 s for 50,000 lines): past LEASE_MS
            part = idxs[at:at + 500]
            lines = self.r.hmget(names.batch_key(batch_id, "lines"), part)
            pipe = self.r.pipeline(transaction=False)
            for idx, raw in zip(part, lines):
                custom = orjson.loads(raw).get("custom_id") if raw else None
                batch_ops.queue_result(pipe, batch_id, idx, orjson.dumps(line_error(custom, code, message)), False)
            scripts.execute(pipe)

    def _finish(self, batch_id: str, rec: dict[str, str], status: str) -> None:
        """Make the results into the output and error files, end the batch as `status`, then announce it."""
        self._hold(batch_id)
        owner = rec.get("owner") or ""
        now = time.time()
        # (keyed Any: redis-py's hset takes a Mapping over a union of key types, which dict[str, ...] is not)
        fields: dict[Any, str | float] = {"status": status, f"{status}_at": now, "finalizing_at": now}
        for part, suffix in (("out", "output"), ("err", "errors")):
            key = names.batch_key(batch_id, part)
            if self.r.hlen(key):
                size = sum(len(v.encode()) + 1 for v in cast("list[str]", self.r.hvals(key)))
                file_id = f"file-{batch_id.removeprefix('batch_')}-{suffix}"
                self._file_of_lines(file_id, owner, f"{batch_id}_{suffix}.jsonl", key, size)
                fields["output_file_id" if part == "out" else "error_file_id"] = file_id
        self.r.hset(names.batch_key(batch_id), mapping=fields)
        self.r.delete(names.batch_key(batch_id, "lines"))  # its copy of the input: nothing reads it once ended
        self._close(batch_id, {**rec, **fields})

    def _file_of_lines(self, file_id: str, owner: str, filename: str, lines_key: str, size: int) -> None:
        """A file whose content is a hash of lines (a batch's results, read in index order), recorded as the
        files API records one (api/files.py `FileStore.of_lines`); it counts against its owner's stored bytes,
        whatever the cap: a batch's results are kept."""
        self.r.expire(lines_key, self.ttl_s)
        if owner:
            scripts.FILE_BYTES(self.r, *file_bytes_write(owner, file_id, size, self.ttl_s))
        pipe = self.r.pipeline(transaction=False)
        file_ops.queue_record(pipe, file_id, owner, "batch_output", filename, size, "lines", lines_key, self.ttl_s)
        pipe.execute()

    def _close(self, batch_id: str, rec: dict[str, Any]) -> None:
        """An ended batch leaves the drivers' set and its key's open batches; one made with a webhook_url is
        first announced on the `ended` stream for the after-job drain. The entry goes before the mark that it
        went, so a driver that stops between the two announces it again: at least once. On a cluster each step
        waits for a replica of what it follows (`_copied`), so that a failover cannot undo the end, or the
        entry, of a batch that no driver holds any more."""
        owner = rec.get("owner") or ""
        if rec.get("webhook_url") and not rec.get("announced"):
            p = names.batch_partition(owner)
            pipe = self.r.pipeline(transaction=False)  # the entry, and a sleeping drain's flag (shared/ring.py)
            pipe.xadd(names.stream(names.ENDED, p), {"batch_id": batch_id},
                      minid=names.ended_min_id(time.time(), self.settings.job_ttl_s), approximate=True)
            ring = names.ring_key(p, names.AFTER_JOB_GROUP)
            pipe.getdel(ring)
            _, flag = pipe.execute()
            if channel := channel_of(flag):
                self.r.publish(channel, ring)
            self._copied([names.stream(names.ENDED, p)])
            self.r.hset(names.batch_key(batch_id), "announced", 1)
        # two slots, one after the other: a batch leaves the driver's set only once its tenant's open count let
        # it go (the other order, cut between the two, would count it open for a day)
        self.r.zrem(names.batches_open(owner), batch_id)
        files = [names.file_key(rec[f], "meta") for f in ("output_file_id", "error_file_id") if rec.get(f)]
        self._copied([names.batch_key(batch_id), names.batches_open(owner), *files])
        self.r.srem(names.BATCHES_ACTIVE, batch_id)

    def _copied(self, keys: list[str]) -> None:
        """On a cluster, return once a replica has what the masters of `keys` answered so far (shared/fence.py);
        else NotCopied, and the next tick closes the batch again (its writes are replays, or redone where a
        failover lost them). A single Redis fsyncs before it answers."""
        if self.fence is not None:
            self.fence.confirm(keys)
