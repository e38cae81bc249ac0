"""The judge API (`/v1/judge`): a submission run against a whole problem's tests in one call.

A judged submission travels through the queue as one call (an ExecRequest whose `judge` holds the
tests); the worker prepares it once and runs every test, comparing outputs outside the jail. Here
the request is admitted (422 for a bad one) and the call's result becomes a JudgeResult.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict

from codeenv.admission import judge_call
from codeenv.api.service import (
    NATIVE_STATUS,
    RETRY_AFTER_S,
    Gateway,
    body_schema,
    conflict_status,
    merge,
    parse,
    split_batch,
)
from codeenv.errors import ApiError, InvalidRequest
from codeenv.models import ExecRequest, ExecResult, JudgeRequest, JudgeResult, Status

#: The routes that take a JSON body (Guard reads and parses it).
JSON_PATHS = frozenset({"/v1/judge", "/v1/judge/batch", "/v1/judge/stream"})


class JudgeBatchRequest(BaseModel):
    """Submissions to judge; each item has the shape of JudgeRequest and is checked on its own."""

    model_config = ConfigDict(json_schema_extra={"examples": [
        {"requests": [{"code": "print(input())", "tests": [{"stdin": "x", "expected_stdout": "x"}]}]},
    ]})

    requests: list[JudgeRequest]


class JudgeBatchResponse(BaseModel):
    """One result per submission, in request order."""

    results: list[JudgeResult]


def _encode(result: ExecResult) -> str:
    return JudgeResult.from_call(result).model_dump_json()


def _admit(item: JudgeRequest, gateway: Gateway) -> ExecRequest:
    try:
        return judge_call(item, gateway.settings)
    except InvalidRequest as exc:
        raise ApiError(422, str(exc)) from None


def router(gateway: Gateway) -> APIRouter:
    api = APIRouter()
    settings = gateway.settings

    @api.post("/v1/judge", response_model=JudgeResult, openapi_extra=body_schema("JudgeRequest"),
              responses={409: {"description": "its id names another call: use a new id"},
                         422: {"description": "the request cannot be judged as sent"},
                         429: {"model": JudgeResult, "description": "overloaded (not run): retry after Retry-After "
                                                                    "seconds"}})
    async def judge(request: Request) -> Response:
        """Run a submission against every test of a problem; one verdict per test."""
        call = _admit(parse(request, JudgeRequest), gateway)
        [result] = await gateway.answer(request, [call])
        if result.status == Status.rejected:
            raise ApiError(conflict_status(result), result.message)
        code = NATIVE_STATUS.get(result.status, 200)
        headers = {"Retry-After": RETRY_AFTER_S} if code != 200 else None
        return Response(_encode(result), code, headers, media_type="application/json")

    def parse_batch(request: Request) -> tuple[list[ExecRequest], list[ExecResult | None]]:
        return split_batch(request, settings.max_batch,
                           lambda item: judge_call(JudgeRequest.model_validate(item), settings), "submissions")

    @api.post("/v1/judge/batch", response_model=JudgeBatchResponse, openapi_extra=body_schema("JudgeBatchRequest"),
              responses={429: {"model": JudgeBatchResponse, "description": "every submission overloaded (none run)"}})
    async def judge_batch(request: Request) -> Response:
        """Judge a batch of submissions; results in request order. An invalid item is `rejected`."""
        valid, refused = parse_batch(request)
        results = merge(refused, await gateway.answer(request, valid))
        payload = '{"results":[' + ",".join(_encode(r) for r in results) + "]}"
        if results and all(r.status == Status.overloaded for r in results):
            return Response(payload, NATIVE_STATUS[Status.overloaded], {"Retry-After": RETRY_AFTER_S},
                            media_type="application/json")
        return Response(payload, media_type="application/json")

    @api.post("/v1/judge/stream", openapi_extra=body_schema("JudgeBatchRequest"),
              responses={200: {"description": '{"accepted": n}, then one JSON line per submission, {"i": index, '
                                              '"result": {...}}, in the order they end',
                               "content": {"application/x-ndjson": {}}}})
    async def judge_stream(request: Request) -> Response:
        """Judge a batch and stream each result as soon as it ends (NDJSON), as /v1/execute/stream."""
        valid, refused = parse_batch(request)
        return gateway.stream(request, valid, refused, _encode)

    return api
