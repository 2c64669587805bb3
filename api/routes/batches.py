"""OpenAI's Files and Batch APIs (api/files.py, api/batches.py; the batches run in the Celery worker,
workers/batch_driver.py). Files and batches belong to the key that made them: every other key gets 404."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, File, Form, Query, Request, UploadFile
from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from api import file_parquet
from api.auth import CallerDep
from api.batches import Batches, batch_object
from api.errors import ApiError
from api.files import FileStore, TooLarge, file_object
from api.openai_schemas import Order, list_page
from shared.limits import Metadata, Name, WebhookUrl, webhook_port_refusal

router = APIRouter(prefix="/v1", tags=["batches"])
UPLOAD_CHUNK = 256 * 1024


def _files(request: Request) -> FileStore:
    return request.app.state.files  # type: ignore[no-any-return]


def _batches(request: Request) -> Batches:
    return request.app.state.batches  # type: ignore[no-any-return]


def _no_file(file_id: str) -> ApiError:
    return ApiError(404, f"no file with id '{file_id}'", param="file_id")


@router.post("/files", response_model=None)
async def upload(request: Request, caller: CallerDep, file: Annotated[UploadFile, File()],
                 purpose: Annotated[str, Form()]) -> Any:
    """Upload a JSONL file (`purpose=batch`); stored as it is read, never held whole."""
    if purpose != "batch":
        raise ApiError(400, "purpose must be 'batch'", param="purpose")

    async def chunks() -> Any:
        while chunk := await file.read(UPLOAD_CHUNK):
            yield chunk

    cap = caller.tenant.max_file_bytes if caller.tenant else 0
    try:
        return await _files(request).upload(caller.owner, purpose, file.filename or "upload.jsonl", chunks(), cap)
    except TooLarge as exc:
        raise ApiError(413, str(exc), param="file") from None
    except ValueError as exc:
        raise ApiError(400, str(exc), param="file") from None


@router.get("/files", response_model=None)
async def list_files(request: Request, caller: CallerDep, limit: Annotated[int, Query(ge=1, le=10_000)] = 100,
                     after: str | None = None, purpose: str | None = None,
                     order: Order = "desc") -> Any:
    """The caller's files, newest first unless `order=asc`; of one `purpose` when given (none of a purpose this
    server does not hold)."""
    data, more = await _files(request).listing(caller.owner, limit, after, purpose, order == "desc")
    return list_page(data, more)


@router.get("/files/{file_id}", response_model=None)
async def get_file(file_id: str, request: Request, caller: CallerDep) -> Any:
    meta = await _files(request).meta(file_id, caller.owner)
    if meta is None:
        raise _no_file(file_id)
    return file_object(meta)


@router.get("/files/{file_id}/content", response_model=None)
async def file_content(file_id: str, request: Request, caller: CallerDep,
                       fmt: Annotated[str, Query(alias="format")] = "jsonl") -> Any:
    """The file as uploaded (JSONL), or with `format=parquet` its lines as a Parquet table (api/file_parquet.py)."""
    if fmt not in ("jsonl", "parquet"):
        raise ApiError(400, "format must be 'jsonl' or 'parquet'", param="format")
    files = _files(request)
    meta = await files.meta(file_id, caller.owner)
    if meta is None:
        raise _no_file(file_id)
    if fmt == "parquet":
        return StreamingResponse(file_parquet.parquet_of(files.lines(meta), meta["purpose"]),
                                 media_type=file_parquet.MEDIA_TYPE)
    return StreamingResponse(files.content(meta), media_type="application/jsonl")


@router.delete("/files/{file_id}", response_model=None)
async def delete_file(file_id: str, request: Request, caller: CallerDep) -> Any:
    files = _files(request)
    meta = await files.meta(file_id, caller.owner)
    if meta is None:
        raise _no_file(file_id)
    await files.delete(meta, promised=True)
    return {"id": file_id, "object": "file", "deleted": True}


class BatchRequest(BaseModel):
    input_file_id: Name
    endpoint: Name
    completion_window: str = "24h"
    metadata: Metadata | None = None
    webhook_url: WebhookUrl | None = None  # POSTed an event (batch.completed, ...) once the batch ends


def _no_batch(batch_id: str) -> ApiError:
    return ApiError(404, f"no batch with id '{batch_id}'", param="batch_id")


@router.post("/batches", response_model=None)
async def create_batch(body: BatchRequest, request: Request, caller: CallerDep) -> Any:
    """Check every line of the input file (a bad line goes to the error file) and queue the rest. The Celery
    worker's batch driver runs them: a stack without one (`conveyor up --celery 0`) leaves the batch in progress."""
    if body.completion_window != "24h":
        raise ApiError(400, "completion_window must be '24h'", param="completion_window")
    ports = request.app.state.settings.webhook_port_set
    if body.webhook_url and (why := webhook_port_refusal(body.webhook_url, ports)):
        raise ApiError(422, f"webhook_url: {why}", param="webhook_url")
    return await _batches(request).create(caller.tenant, body.input_file_id, body.endpoint, body.metadata,
                                          body.webhook_url)


@router.get("/batches/{batch_id}", response_model=None)
async def get_batch(batch_id: str, request: Request, caller: CallerDep) -> Any:
    rec = await _batches(request).get(batch_id, caller.owner)
    if rec is None:
        raise _no_batch(batch_id)
    return batch_object(rec)


@router.get("/batches", response_model=None)
async def list_batches(request: Request, caller: CallerDep, limit: Annotated[int, Query(ge=1, le=100)] = 20,
                       after: str | None = None) -> Any:
    data, more = await _batches(request).listing(caller.owner, limit, after)
    return list_page(data, more)


@router.post("/batches/{batch_id}/cancel", response_model=None)
async def cancel_batch(batch_id: str, request: Request, caller: CallerDep) -> Any:
    """Stop submitting lines and cancel those running; finished lines are kept."""
    rec = await _batches(request).cancel(batch_id, caller.owner)
    if rec is None:
        raise _no_batch(batch_id)
    return batch_object(rec)
