"""Which zygote profile serves a call: a bounded textual scan of its import lines, never a parse.

Untrusted code is parsed nowhere but in a jailed child (shared/DESIGN.md, invariant 1); this only
looks for ``import x`` / ``from x import`` at the start of lines in the first SCAN_BYTES of the code.
A wrong guess costs time (the child imports what was not preloaded), never correctness.
"""

from __future__ import annotations

import re
import sys

from codeenv.sandbox.image import Profile

SCAN_BYTES = 64 << 10
_IMPORT = re.compile(
    rb"^[ \t]*(?:from[ \t]+([A-Za-z_][\w]*)|import[ \t]+([A-Za-z_][\w.]*(?:[ \t]*,[ \t]*[A-Za-z_][\w.]*)*))",
    re.MULTILINE,
)
# Ways to import that the scan cannot see; they send a call to the heaviest profile.
_DYNAMIC = re.compile(rb"__import__|importlib|exec\(|eval\(")
STDLIB = frozenset(sys.stdlib_module_names)


def imported_modules(code: bytes) -> set[str] | None:
    """Top-level module names the code's import lines name; None if it may import dynamically."""
    head = code[:SCAN_BYTES]
    if _DYNAMIC.search(head):
        return None
    names: set[str] = set()
    for from_name, import_list in _IMPORT.findall(head):
        if from_name:
            names.add(from_name.decode())
        else:
            for part in import_list.split(b","):
                names.add(part.strip().split(b".")[0].split()[0].decode())
    return names


def _covers(profile: Profile, modules: set[str]) -> bool:
    if "*" in profile.covers:
        return True
    allowed = set(profile.covers)
    if "@stdlib" in allowed:
        allowed |= STDLIB
    return modules <= allowed


def choose_profile(code: bytes, profiles: list[Profile]) -> Profile:
    """The lightest profile (the first, in declaration order) that covers the code's imports."""
    modules = imported_modules(code)
    if modules is None:
        return profiles[-1]
    for profile in profiles:
        if _covers(profile, modules):
            return profile
    return profiles[-1]
