"""The judge API (`/v1/judge`): a submission run against a whole problem's tests in one call.

A judged submission travels through the queue as one call (an ExecRequest whose `judge` holds the
tests); the worker prepares it once and runs every test, comparing outputs outside the jail. Here
the request becomes that call (the gateway admits it: 422 for a bad one) and its result a JudgeResult.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict

from codeenv.admission import to_judge_call
from codeenv.api.service import Gateway, body_schema, merge, parse, split_batch
from codeenv.api.statuses import NATIVE, answered, answered_batch
from codeenv.errors import ApiError, InvalidRequest
from codeenv.models import ExecRequest, ExecResult, JudgeRequest, JudgeResult

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


def _call(item: JudgeRequest) -> ExecRequest:
    try:
        return to_judge_call(item)
    except InvalidRequest as exc:
        raise ApiError(422, str(exc)) from None


def router(gateway: Gateway) -> APIRouter:
    api = APIRouter()
    settings = gateway.settings

    @api.post("/v1/judge", response_model=JudgeResult, openapi_extra=body_schema("JudgeRequest"),
              responses={409: {"description": "its id names another call: use a new id; or problem_unknown: its "
                                              "problem is not held here (upload it, send again)"},
                         422: {"description": "the request cannot be judged as sent"},
                         429: {"model": JudgeResult, "description": "overloaded (not run): retry after Retry-After "
                                                                    "seconds"}})
    async def judge(request: Request) -> Response:
        """Run a submission against every test of a problem; one verdict per test."""
        [result] = await gateway.answer(request, [_call(parse(request, JudgeRequest))])
        code, headers = answered(result, NATIVE)  # a refused call: its 4xx
        return Response(_encode(result), code, headers, media_type="application/json")

    def parse_batch(request: Request) -> tuple[list[ExecRequest], list[ExecResult | None]]:
        return split_batch(request, settings.max_batch, lambda item: to_judge_call(JudgeRequest.model_validate(item)),
                           "submissions")

    @api.post("/v1/judge/batch", response_model=JudgeBatchResponse, openapi_extra=body_schema("JudgeBatchRequest"),
              responses={429: {"model": JudgeBatchResponse, "description": "every submission overloaded (none run)"}})
    async def judge_batch(request: Request) -> Response:
        """Judge a batch of submissions; results in request order. An invalid item is `rejected`."""
        valid, refused = parse_batch(request)
        results = merge(refused, await gateway.answer(request, valid))
        payload = '{"results":[' + ",".join(_encode(r) for r in results) + "]}"
        code, headers = answered_batch(results, NATIVE)
        return Response(payload, code, headers, media_type="application/json")

    @api.post("/v1/judge/stream", openapi_extra=body_schema("JudgeBatchRequest"),
              responses={200: {"description": '{"accepted": n}, then one JSON line per submission, {"i": index, '
                                              '"result": {...}}, in the order they end',
                               "content": {"application/x-ndjson": {}}}})
    async def judge_stream(request: Request) -> Response:
        """Judge a batch and stream each result as soon as it ends (NDJSON), as /v1/execute/stream."""
        valid, refused = parse_batch(request)
        return gateway.stream(request, valid, refused, _encode)

    return api
