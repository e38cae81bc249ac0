"""The gateway's one table of HTTP statuses (codeenv/api/statuses.py), and the API answering each
outcome by it: refusals by their kind (data, not message text), session errors by theirs. Over
tests.fakes.FakeQueue: no jail."""

from __future__ import annotations

import httpx
import pytest

from codeenv.api import statuses
from codeenv.errors import ApiError, SessionError, SessionErrorKind
from codeenv.models import SESSION_KEY_HEADER, ExecRequest, ExecResult, Refusal, Status
from tests.conftest import GatewayClient
from tests.fakes import FakeQueue

pytestmark = pytest.mark.unit


def test_every_kind_has_a_status() -> None:
    assert set(statuses.SESSION_ERRORS) == set(SessionErrorKind)
    assert set(statuses.REFUSALS) == {*Refusal, None}
    for kind, code in statuses.SESSION_ERRORS.items():
        error = statuses.session_error(SessionError("why", kind))
        assert (error.status_code, error.detail) == (code, "why")
        assert (error.headers is not None) == (code == 429)


def test_a_result_answered_alone() -> None:
    ok = ExecResult(status=Status.ok)
    assert statuses.answered(ok, statuses.NATIVE) == (200, None)
    overloaded = ExecResult(status=Status.overloaded)
    assert statuses.answered(overloaded, statuses.NATIVE) == (429, {"Retry-After": statuses.RETRY_AFTER_S})
    assert statuses.answered(overloaded, statuses.SANDBOX_FUSION)[0] == 504
    lost = ExecResult(status=Status.session_lost)
    assert statuses.answered(lost, statuses.SESSION_CELL) == (410, None)
    assert statuses.answered(lost, statuses.NATIVE) == (200, None)
    for refusal, code in ((Refusal.no_session, 404), (Refusal.id_taken, 409), (Refusal.invalid, 422), (None, 422)):
        with pytest.raises(ApiError) as refused:
            statuses.answered(ExecResult(status=Status.rejected, refusal=refusal, message="m"), statuses.NATIVE)
        assert (refused.value.status_code, refused.value.detail) == (code, "m")


def test_a_batch_is_429_only_when_no_call_ran() -> None:
    over, ok = ExecResult(status=Status.overloaded), ExecResult(status=Status.ok)
    assert statuses.answered_batch([over, over], statuses.NATIVE)[0] == 429
    assert statuses.answered_batch([over, ok], statuses.NATIVE) == (200, None)
    assert statuses.answered_batch([], statuses.NATIVE) == (200, None)


def test_a_result_without_a_refusal_still_reads() -> None:
    """The wire stays compatible: a result from an older worker has no `refusal`."""
    old = ExecResult.from_json('{"status": "rejected", "message": "no"}')
    assert old.refusal is None and old.status is Status.rejected
    assert ExecResult.model_validate_json(ExecResult(status=Status.rejected, refusal=Refusal.id_taken)
                                          .model_dump_json()).refusal is Refusal.id_taken


@pytest.mark.parametrize(("refusal", "code"), [(Refusal.no_session, 404), (Refusal.id_taken, 409),
                                               (Refusal.invalid, 422)])
async def test_the_api_answers_a_refusal_by_its_kind(gateway: GatewayClient, refusal: Refusal, code: int) -> None:
    def refuse(request: ExecRequest) -> ExecResult:
        return ExecResult(id=request.id, status=Status.rejected, refusal=refusal, message="a message of no form")

    async with gateway(queue=FakeQueue(refuse)) as client:
        one = await client.post("/v1/execute", json={"code": "1"})
        assert one.status_code == code and one.json()["detail"] == "a message of no form"
        judged = await client.post("/v1/judge", json={"code": "1", "tests": [{"stdin": "", "expected_stdout": ""}]})
        assert judged.status_code == code
        batch = await client.post("/v1/execute/batch", json={"requests": [{"code": "1"}]})
        assert batch.status_code == 200 and batch.json()["results"][0]["refusal"] == refusal.value


async def test_the_gateway_admits_each_call_once_before_the_queue(gateway: GatewayClient) -> None:
    queue = FakeQueue()
    async with gateway(queue=queue, max_code_bytes=100) as client:
        r = await client.post("/v1/execute/batch", json={"requests": [
            {"code": "#" * 101, "id": "big"}, {"code": "print(1)", "id": "fine"},
            {"code": "1", "limits": {"wall_s": 10**6}}, {"code": "1", "session": "s"}]})
        results = r.json()["results"]
        assert [x["status"] for x in results] == ["rejected", "ok", "rejected", "rejected"]
        assert {x["refusal"] for x in results if x["status"] == "rejected"} == {"invalid"}
        assert "the limit is 100" in results[0]["message"] and results[0]["id"] == "big"
        assert "embedded mode" in results[3]["message"]  # this queue runs no sessions
        assert [c.id for c in queue.calls] == ["fine"]  # the refused ones never reached it
        stream = await client.post("/v1/execute/stream", json={"requests": [{"code": "#" * 101}, {"code": "2"}]})
        lines = [httpx.Response(200, content=line).json() for line in stream.content.splitlines()]
        assert lines[0] == {"accepted": 2}
        assert {line["i"]: line["result"]["status"] for line in lines[1:]} == {0: "rejected", 1: "ok"}
        test = {"stdin": "", "expected_stdout": ""}
        judged = await client.post("/v1/judge", json={"code": "#" * 101, "tests": [test]})
        assert judged.status_code == 422 and "the limit is 100" in judged.text
        assert len(queue.calls) == 2


async def test_a_queue_without_sessions_answers_501(gateway: GatewayClient) -> None:
    async with gateway(queue=FakeQueue(), headers={SESSION_KEY_HEADER: "a-key-of-this-test-client"}) as client:
        for method, path in (("POST", "/v1/sessions"), ("GET", "/v1/sessions"), ("GET", "/v1/sessions/x"),
                             ("POST", "/v1/sessions/x/fork"), ("DELETE", "/v1/sessions/x"),
                             ("POST", "/v1/sessions/x/execute")):
            body = {"code": "1"} if path.endswith("/execute") else {} if method == "POST" else None
            r = await client.request(method, path, json=body)
            assert r.status_code == 501 and "embedded mode" in r.text, (method, path, r.text)
        one = await client.post("/v1/execute", json={"code": "1", "session": "x"})
        assert one.status_code == 422 and "embedded mode" in one.text
        assert not [p for p in (await client.get("/openapi.json")).json()["paths"] if p.startswith("/v1/sessions")]


async def test_a_queue_from_before_sessions_runs_none(gateway: GatewayClient) -> None:
    """A CallQueue written before `sessions` joined the interface still serves calls (and no session)."""

    class Older(FakeQueue):
        def __getattribute__(self, name: str) -> object:
            if name == "sessions":
                raise AttributeError(name)
            return super().__getattribute__(name)

    async with gateway(queue=Older()) as client:
        assert (await client.post("/v1/execute", json={"code": "1", "stdin": "x"})).json()["stdout"] == "x"
        assert (await client.get("/v1/sessions")).status_code == 501
