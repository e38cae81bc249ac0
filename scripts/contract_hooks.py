"""What the API document cannot say, for schemathesis (scripts/contract sets SCHEMATHESIS_HOOKS).

A judged submission's `subtasks` name its tests by index: that an index is below the number of
tests relates two values of the body, which JSON Schema cannot express. A body whose subtasks name
a test it does not have is a 422 that says which; such bodies are left out of the generated cases.
"""

from __future__ import annotations

from typing import Any

import schemathesis


def _names_missing_tests(judged: Any) -> bool:
    if not isinstance(judged, dict):
        return False
    subtasks, tests = judged.get("subtasks"), judged.get("tests")
    if not isinstance(subtasks, list) or not isinstance(tests, list):
        return False
    return any(isinstance(s, dict) and isinstance(s.get("tests"), list)
               and any(isinstance(i, (int, float)) and not 0 <= i < len(tests) for i in s["tests"])
               for s in subtasks)


@schemathesis.hook
def filter_body(ctx: Any, body: Any) -> bool:
    if not isinstance(body, dict):
        return True
    items = body.get("requests") if isinstance(body.get("requests"), list) else [body]
    return not any(_names_missing_tests(item) or (isinstance(item, dict) and _names_missing_tests(item.get("judge")))
                   for item in items)
