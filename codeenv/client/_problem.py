"""A problem package on the client's side: its body made once, named by its sha256.

Usage::

    problem = Problem(tests=[{"stdin": "1 2", "expected_stdout": "3"}], limits={"cpu_s": 1})
    result = await client.judge(code, problem=problem)   # by reference: uploaded once, on its first 409
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

from codeenv.models import ProblemPackage


class Problem:
    """A problem's tests, checker, graders and limits (the fields of ProblemPackage), sent once.

    Its `body` is the package's JSON as uploaded and `sha256` its name: judged submissions carry
    only the name. The same problem built twice has the same name (fields in one order, only those
    given)."""

    def __init__(self, tests: Sequence[Mapping[str, Any]], *, fn_name: str | None = None,
                 compare: str | None = None, float_tol: float | None = None,
                 checker: Mapping[str, Any] | None = None, graders: Mapping[str, str] | None = None,
                 limits: Mapping[str, Any] | None = None, total_wall_s: float | None = None) -> None:
        given = {"tests": [dict(t) for t in tests], "fn_name": fn_name, "compare": compare, "float_tol": float_tol,
                 "checker": None if checker is None else dict(checker),
                 "graders": None if graders is None else dict(graders),
                 "limits": None if limits is None else dict(limits), "total_wall_s": total_wall_s}
        # Validated as the service will (pydantic's ValidationError here, not a 422 later).
        self.package = ProblemPackage.model_validate({k: v for k, v in given.items() if v is not None},
                                                     strict=False)
        self.body = self.package.model_dump_json(exclude_unset=True).encode()
        self.sha256 = hashlib.sha256(self.body).hexdigest()

    @classmethod
    def from_json(cls, body: bytes) -> Problem:
        """A package already serialized (e.g. read from a file): uploaded as these exact bytes."""
        problem = cls.__new__(cls)
        problem.package = ProblemPackage.model_validate_json(body)
        problem.body = bytes(body)
        problem.sha256 = hashlib.sha256(problem.body).hexdigest()
        return problem

    def __repr__(self) -> str:
        return f"Problem({self.sha256[:12]}, {len(self.package.tests)} tests, {len(self.body)} bytes)"
