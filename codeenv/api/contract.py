"""The OpenAPI document says what every operation takes and returns, as this server enforces it.

FastAPI writes most of it from the routes; `complete` adds what the routes cannot say by
themselves:

- the answers every operation may give before its handler runs (the Guard's): 403 for a request a
  web page could forge, 401 without the token (when one is set), and for a JSON body 400 (not
  JSON, nested too deep), 413 (too large), 415 (not `application/json`), 422 (not the model);
- the content types that are not JSON: `/metrics` (Prometheus text), the NDJSON streams;
- the bounds this server's settings put on requests: each limit's cap, the most items in a batch,
  tests in a judged submission, files per call, and the image's profiles by name; so that a
  request the document accepts is not refused for a reason it could have said.
"""

from __future__ import annotations

from typing import Any

from prometheus_client.exposition import CONTENT_TYPE_LATEST

from codeenv.models import CPP_FIELDS_SET, FN_NAME_PATTERN, PROBLEM_FIELDS
from codeenv.settings import GatewaySettings

ERROR_SCHEMA: dict[str, Any] = {
    "title": "Error",
    "type": "object",
    "required": ["detail"],
    "properties": {"detail": {"anyOf": [
        {"type": "string"},
        {"type": "array", "items": {"$ref": "#/components/schemas/ValidationIssue"}},
    ], "description": "what is wrong, as a sentence or (a body that is not the model) one item per problem"}},
}
VALIDATION_ISSUE: dict[str, Any] = {
    "title": "ValidationIssue",
    "type": "object",
    "required": ["loc", "msg", "type"],
    "properties": {"loc": {"type": "array", "items": {"anyOf": [{"type": "string"}, {"type": "integer"}]}},
                   "msg": {"type": "string"}, "type": {"type": "string"}},
}
#: The answers of the Guard (codeenv.api.guard), before any handler.
BEFORE_ANY = {"403": "refused: a request a web page could forge (an Origin not allowed, or without a token a "
                     "Host that is not this service's)"}
WITHOUT_TOKEN = {"401": "missing or wrong token: send 'Authorization: Bearer <token>'"}
BEFORE_JSON = {
    "400": "the body is not JSON, or it is nested too deeply",
    "413": "the body is larger than the server takes (max_body_bytes)",
    "415": "the body is not sent as 'Content-Type: application/json'",
    "422": "the body is not what this operation takes: detail says what to fix",
}
#: Responses that stream NDJSON.
STREAMS = ("/v1/execute/stream", "/v1/judge/stream")
#: Arrays bounded by max_batch: (schema, property).
BATCHES = (("BatchRequest", "requests"), ("JudgeBatchRequest", "requests"), ("BatchSubmission", "submissions"),
           ("ScriptBatch", "scripts"))


#: A file path admission.check_path takes: relative, parts neither empty nor "." nor "..", no NUL.
PATH_PATTERN = r"^(?!\.\.?(?:/|$))[^/\x00]+(?:/(?!\.\.?(?:/|$))[^/\x00]+)*$"
PATH = {"type": "string", "pattern": PATH_PATTERN, "maxLength": 1024}
#: Base64 as base64.b64decode(validate=True) takes it.
BASE64 = {"type": "string", "pattern": r"^(?:[A-Za-z0-9+/]{4})*(?:[A-Za-z0-9+/]{2}==|[A-Za-z0-9+/]{3}=)?$"}
#: The judge's language cpp, in any case.
CPP = "^[Cc][Pp][Pp]$"
#: A judged submission's tests, as _check_tests takes them: stdin tests without fn_name (stdin and
#: expected_stdout, no args or expected), function-call tests with it (args and expected, no stdin).
JUDGE_TESTS = {"allOf": [
    # the tests, or a problem that holds them (and then none of what its package holds)
    {"anyOf": [{"required": ["tests"], "properties": {"tests": {"type": "array"}}},
               {"required": ["problem"], "properties": {"problem": {"type": "string"}}}]},
    {"if": {"required": ["problem"], "properties": {"problem": {"type": "string"}}},
     "then": {"not": {"anyOf": [{"required": [name]} for name in sorted(PROBLEM_FIELDS)]}}},
    # C++ (models.JudgeRequest._supported): preset, std and graders only with it; stdin tests only
    {"if": CPP_FIELDS_SET, "then": {"required": ["language"], "properties": {"language": {"pattern": CPP}}}},
    {"if": {"required": ["language"], "properties": {"language": {"pattern": CPP}}},
     "then": {"properties": {"fn_name": {"type": "null"}}}},
    # an interactive problem has its interactor (or a package holds it)
    {"if": {"required": ["interactive"], "properties": {"interactive": {"const": True}}},
     "then": {"anyOf": [{"required": ["interactor"], "properties": {"interactor": {"type": "object"}}},
                        {"required": ["problem"], "properties": {"problem": {"type": "string"}}}]}},
    # a checker or interactor judges stdin tests
    {"if": {"required": ["interactor"], "properties": {"interactor": {"type": "object"}}},
     "then": {"properties": {"fn_name": {"type": "null"}}}},
    {"if": {"required": ["checker"], "properties": {"checker": {"type": "object"}}},
     "then": {"properties": {"fn_name": {"type": "null"}}}},
    {"if": {"required": ["fn_name"], "properties": {"fn_name": {"type": "string"}}},
     "then": {"properties": {"tests": {"items": {"required": ["expected"],
                                                  "not": {"anyOf": [{"required": ["stdin"]},
                                                                    {"required": ["expected_stdout"]}]}}}}},
     "else": {"properties": {"tests": {"items": {"required": ["expected_stdout"],
                                                  "properties": {"expected_stdout": {"type": "string"}},
                                                  "not": {"anyOf": [{"required": ["args"]},
                                                                    {"required": ["expected"]}]}}}}}},
]}


#: Files in and out (input_mode file) are for stdin tests, not interactive ones (models._check_input_mode).
FILE_IO = {"if": {"required": ["input_mode"], "properties": {"input_mode": {"const": "file"}}},
           "then": {"properties": {"fn_name": {"type": "null"}, "interactor": {"type": "null"}}}}
#: An interactor with several processes or fifo_io (a manager's) runs a compiled program
#: (models.ExecRequest._session_cell).
SEVERAL = {"type": "object", "anyOf": [{"required": ["processes"], "properties": {"processes": {"minimum": 2}}},
                                       {"required": ["user_io"], "properties": {"user_io": {"const": "fifo_io"}}}]}
JUDGE_TESTS["allOf"] += [
    FILE_IO,
    {"if": {"required": ["interactor"], "properties": {"interactor": SEVERAL}},
     "then": {"required": ["language"], "properties": {"language": {"pattern": CPP}}}},
]
#: A problem package's tests, as ProblemPackage._fits takes them (what JUDGE_TESTS says of tests).
PACKAGE_TESTS = {"allOf": [*JUDGE_TESTS["allOf"][-5:-2], FILE_IO]}
#: What is a manager's alone (models.InteractorSpec._fits).
INTERACTOR = {"allOf": [
    {"if": {"not": {"required": ["protocol"], "properties": {"protocol": {"const": "manager"}}}},
     "then": {"properties": {"processes": {"const": 1}, "user_io": {"const": "std_io"},
                             "manager_args": {"maxItems": 0}}}},
]}


JUDGE_SPEC_TESTS = {"allOf": [
    FILE_IO,
    # the tests or a problem that holds them (models.JudgeSpec._tests_fit)
    {"oneOf": [{"required": ["tests"], "properties": {"tests": {"minItems": 1},
                                                      "problem": {"type": "null"}}},
               {"required": ["problem"], "properties": {"problem": {"type": "object"},
                                                        "tests": {"maxItems": 0}}}]},
    {"if": {"required": ["fn_name"], "properties": {"fn_name": {"type": "string"}}},
     "then": {"properties": {"tests": {"items": {"properties": {"stdin": {"type": "null"},
                                                                 "expected_stdout": {"type": "null"}}}}}},
     "else": {"properties": {"tests": {"items": {"required": ["expected_stdout"], "properties": {
         "expected_stdout": {"type": "string"}, "args": {"type": "null"}, "expected": {"type": "null"}}}}}}},
]}


def _error(description: str) -> dict[str, Any]:
    return {"description": description,
            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}


def _bounds(components: dict[str, Any], settings: GatewaySettings, profiles: list[str]) -> None:
    limits = components.get("Limits", {}).get("properties", {})
    for name, cap in settings.caps.model_dump().items():
        for option in limits.get(name, {}).get("anyOf", [limits.get(name, {})]):
            if option.get("type") in ("number", "integer"):
                option["maximum"] = cap
    for schema, prop in BATCHES:
        field = components.get(schema, {}).get("properties", {}).get(prop)
        if field is not None:
            field["maxItems"] = settings.max_batch
    tests = components.get("JudgeRequest", {}).get("properties", {}).get("tests")
    if tests is not None:
        tests["maxItems"] = settings.judge_max_tests
    for schema in ("ExecRequest", "RunCodeRequest"):
        props = components.get(schema, {}).get("properties", {})
        if "files" in props:
            props["files"].update(maxProperties=settings.max_files, propertyNames=PATH)
            values = props["files"].get("additionalProperties", {})
            if values.get("type") == "string":
                values.update(BASE64)
            for option in values.get("anyOf", []):
                if option.get("type") == "string":
                    option.update(BASE64)
        if "fetch_files" in props:
            props["fetch_files"].update(maxItems=settings.max_files, items=PATH)
    spec = components.get("JudgeSpec")
    if spec is not None:  # as a queue carries it: the fields that are not null count
        spec.update(JUDGE_SPEC_TESTS)
        spec_props = spec.get("properties", {})
        if "tests" in spec_props:
            spec_props["tests"]["maxItems"] = settings.judge_max_tests
        for option in spec_props.get("total_wall_s", {}).get("anyOf", []):
            if option.get("type") == "number":
                option["maximum"] = settings.judge_max_total_wall_s
        for option in spec.get("properties", {}).get("fn_name", {}).get("anyOf", []):
            if option.get("type") == "string":
                option["pattern"] = FN_NAME_PATTERN
    interactor = components.get("InteractorSpec")
    if interactor is not None:
        interactor.update(INTERACTOR)
    execute = components.get("ExecRequest")
    if execute is not None:  # a judged call's interactor of several processes: language cpp
        execute.setdefault("allOf", []).append(
            {"if": {"required": ["judge"], "properties": {"judge": {
                "type": "object", "required": ["interactor"], "properties": {"interactor": SEVERAL}}}},
             "then": {"required": ["language"], "properties": {"language": {"const": "cpp"}}}})
    package = components.get("ProblemPackage")
    if package is not None:
        package.update(PACKAGE_TESTS)
        for option in package.get("properties", {}).get("fn_name", {}).get("anyOf", []):
            if option.get("type") == "string":
                option["pattern"] = FN_NAME_PATTERN
    judge = components.get("JudgeRequest")
    if judge is not None:
        judge.update(JUDGE_TESTS)
        for option in judge.get("properties", {}).get("total_wall_s", {}).get("anyOf", []):
            if option.get("type") == "number":
                option["maximum"] = settings.judge_max_total_wall_s
        fn = judge.get("properties", {}).get("fn_name", {})
        for option in fn.get("anyOf", []):
            if option.get("type") == "string":
                option["pattern"] = FN_NAME_PATTERN
    # A batch item that is not a call is answered `rejected` in its place, not refused as a whole.
    for schema in ("BatchRequest", "JudgeBatchRequest"):
        field = components.get(schema, {}).get("properties", {}).get("requests")
        if field is not None:
            field["items"] = {"anyOf": [field["items"], {
                "description": "anything else: answered `rejected` in its place, the others run"}]}
    for schema in ("ExecRequest", "SessionCreate"):
        profile = components.get(schema, {}).get("properties", {}).get("profile")
        if profile is not None and profiles:
            profile["anyOf"] = [{"type": "string", "enum": profiles}, {"type": "null"}]


def _without_sessions(schema: dict[str, Any], components: dict[str, Any]) -> None:
    """A gateway whose queue runs no sessions: its document has no session endpoints (they answer 501),
    and a call cannot name a session."""
    for path in [p for p in schema.get("paths", {}) if p.startswith(("/v1/sessions", "/v1/snapshots"))]:
        del schema["paths"][path]
    execute = components.get("ExecRequest", {})
    for name in ("session", "cell_id"):
        execute.get("properties", {}).pop(name, None)
    rules = [r for r in execute.get("allOf", [])
             if not set(r.get("if", {}).get("required", [])) & {"session", "cell_id"}]
    if rules:
        execute["allOf"] = rules
    else:
        execute.pop("allOf", None)


#: The header that names whom sessions belong to (models.SESSION_KEY_HEADER), on the operations that
#: reach a session: the session endpoints, and the calls that may name one.
SESSION_KEY = {"name": "X-Codeenv-Session-Key", "in": "header", "required": False, "schema": {
    "type": "string", "minLength": 16, "maxLength": 256, "pattern": "^[!-~]+$"},
    "description": "whose sessions: a secret of yours, sent with every request about them (POST /v1/sessions "
                   "without it makes one and returns it as session_key); another key gets 404"}
SESSION_KEY_PATHS = ("/v1/sessions", "/v1/execute")
BAD_SESSION_KEY = "the X-Codeenv-Session-Key header is not 16 to 256 visible ASCII characters, or the body is not " \
                  "what this operation takes: detail says what to fix"


def complete(schema: dict[str, Any], settings: GatewaySettings, profiles: list[str],
             sessions: bool = True) -> dict[str, Any]:
    """Add to FastAPI's document what the routes cannot say by themselves (see the module's doc)."""
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    if not sessions:
        _without_sessions(schema, components)
    components["Error"] = ERROR_SCHEMA
    components["ValidationIssue"] = VALIDATION_ISSUE
    _bounds(components, settings, profiles)
    before = {**BEFORE_ANY, **(WITHOUT_TOKEN if settings.token is not None else {})}
    for path, operations in schema.get("paths", {}).items():
        for operation in operations.values():
            responses = operation.setdefault("responses", {})
            answers = dict(before)
            if "requestBody" in operation:
                answers.update(BEFORE_JSON)
            if sessions and path.startswith(SESSION_KEY_PATHS):
                operation.setdefault("parameters", []).append(SESSION_KEY)
                answers.setdefault("422", BAD_SESSION_KEY)
            for code, description in answers.items():
                responses.setdefault(code, _error(description))
            for code, response in responses.items():
                if code.startswith(("4", "5")) and "content" not in response:
                    response["content"] = _error("")["content"]
            if path == "/metrics":
                responses["200"]["content"] = {CONTENT_TYPE_LATEST: {"schema": {"type": "string"}}}
            elif path in STREAMS:
                ok = responses["200"]
                ok["content"] = {"application/x-ndjson": ok.get("content", {}).get("application/x-ndjson", {
                    "schema": {"type": "string"}})}
    return schema
