"""Former home of the worker's side of a jail, now `codeenv.sandbox.outside`: these names stay
importable from here while other modules move (calls.CallJail was ZygoteProcess)."""

from codeenv.sandbox.outside.call_io import Exited, Outcome, collect
from codeenv.sandbox.outside.calls import CallJail
from codeenv.sandbox.outside.process import write_oom_score
from codeenv.sandbox.outside.submission import Submission, TestOutcome

ZygoteProcess = CallJail

__all__ = ["Exited", "Outcome", "Submission", "TestOutcome", "ZygoteProcess", "collect", "write_oom_score"]
