"""What the worker and the programs in the jail must agree on: every channel's fds, op names and framing.

Both ends import this module (the jail's copy and the worker's ``codeenv.sandbox.inside.protocol``),
so a fact of the protocol is written once. Messages are JSON objects with an "op"; fds travel as
SCM_RIGHTS beside them. Five channels:

Control socket (worker <-> zygote, fd CTL_FD in the jail; `Ctl`)::

    zygote -> worker  {"op": "hello", ...}                      preloaded and ready
    worker -> zygote  {"op": "run", "seq", limits...} + 6 fds   start a call (`CallFd`: code, stdin,
                                                                stdout, stderr, report and setup memfds)
                      ... + 9 fds, "fetch": bool                also files to write into the work dir
                                                                (the child writes them), a list of paths
                                                                to fetch and a memfd for them (a collector
                                                                child reads them after the call, before
                                                                the wipe)
                      ... + 7 fds, "judge": mode                a judged call: the 7th fd is the judge
                                                                channel's socket (see below)
    (no message)      a byte set in the setup memfd             written before the fork: from here on
                                                                the call counts as started
    zygote -> worker  {"op": "forked", "seq"}                   no spare child: a fresh one waits until
    worker -> zygote  {"op": "go", "seq"}                       the worker has raised its OOM score
    worker -> zygote  {"op": "kill", "seq"}                     stop the call now (output cap, cancel)
    zygote -> worker  {"op": "exited", "seq", status...}        every process of the call is gone
    zygote -> worker  {"op": "ready", "seq", "clean"}           traces wiped; ready for the next call
                                                                (folded into "exited", as "also_ready":
                                                                true, when the call left nothing to wipe)
    worker -> zygote  {"op": "renew", "seq"}                    the call used the network: a fresh
    zygote -> worker  {"op": "ready", "seq", "clean"}           network namespace (no restart), and
                                                                the spare (if any) forked again in it
    worker -> zygote  {"op": "ping"}  ->  {"op": "pong"}        liveness
  In a session jail, instead of calls:
    worker -> zygote  {"op": "create", "fid", "uid", ...} + 1 fd (the family socket)
    zygote -> worker  {"op": "created", "fid"} + a pidfd of the family's supervisor, or "error"
    worker -> zygote  {"op": "end", "fid"}  ->  {"op": "ended", "fid"}

Judge channel (worker <-> a submission's process; `Judge`)::

    us -> worker  {"op": "prepared", "cpu_s"}                  ready for tests
                  {"op": "prepared", "compile_error", "stderr"} the code does not compile
                  {"op": "prepared", "unshared": why}           function tests whose top-level state a
                                                                fork cannot keep: the worker asks again
                                                                with judge=function_inline
    worker -> us  {"op": "test", "i", "cpu_s", "wall_s"} + 6 fds (as a call's; CODE holds the args)
    worker -> us  {"op": "kill"}                               stop the running test
    us -> worker  {"op": "done", "i", "wait_status", "wall_s", "cpu_s", "maxrss_kb", ...}

Family socket (worker <-> a family's supervisor; `Family`)::

    worker -> sup  {"op": "go"}                                  the supervisor is in its cgroup
    sup -> worker  {"op": "ready", "sid": 0, "pid"}              the first session is idle (its pid here)
    worker -> sup  {"op": "cell", "sid", "seq", limits...} + 6 fds (as a call's)
    sup -> worker  {"op": "cell_started", "seq"}                 the cell's process exists (its pid is known)
    worker -> sup  {"op": "go"}                                  its OOM score is set: it may run
    sup -> worker  {"op": "cell_over", "seq"}                    rolled back: the pre-cell process waits
    worker -> sup  {"op": "resume"}                              for the worker to lift the cell's limits
    sup -> worker  {"op": "cell_done", "seq", "kept", "wait_status", "exit_code", "timed_out",
                    "killed", "wall_s", "lost", "written", "unrestored"}
    worker -> sup  {"op": "kill", "seq"}                         stop the running cell (rolled back)
    sup -> worker  {"op": "host_call", "seq", "n", "name", "args", "kwargs"}  a cell calls a host function
    worker -> sup  {"op": "host_result", "seq", "n", "ok", "value"|"error"}  its answer (the supervisor passes
                                                                 it to the cell; one call of a cell at a time)
    worker -> sup  {"op": "fork", "sid", "new_sids", "apart", "snapshot"}  ->  {"op": "forked", "pids",
                                                                 "refused"}  N forks of one session at
                                                                 once ("pids": each one's, null if it was
                                                                 not made; "snapshot": the one fork holds
                                                                 its work dir in its memory)
    worker -> sup  {"op": "close", "sid"}  ->  {"op": "closed", "sid"}
    worker -> sup  {"op": "ping"}  ->  {"op": "pong"}

Session channel (supervisor <-> a session's process; `Session`)::

    sup -> session  {"op": "cell", ...} + 7 fds (`CellFd`: a call's 6, and the cell channel)
    session -> sup  {"op": "reaped", "wait_status", "unrestored"}  its rolled-back cell's process is gone
                                                                 (and what the rollback could not restore)
    sup -> session  {"op": "fork", "sid", "new_sid", "apart", "snapshot"} + 1 fd  the new session's
                                                                 channel ("apart": it enters a Landlock
                                                                 domain of its own; "snapshot": it reads
                                                                 the dir into its memory, where its own
                                                                 forks' dirs come from)
    sup -> session  {"op": "reap"}                               a fork of its was closed: reap it
    session -> sup  {"op": "hello", "copied"}                    (on a new channel) a session started
    session -> sup  {"op": "hello", "refused"}                   (on a new channel) a fork that could not

Cell channel (a cell's process <-> the supervisor; `Cell`; the kernel tells its pid, SO_PASSCRED)::

    cell -> sup  {"op": "started"}                               the cell's process is ready
    sup -> cell  {"op": "go"}                                    the worker has set its OOM score: run
    cell -> sup  {"op": "done", "exit_code"}                     it ended by itself: it is the session now
    cell -> sup  {"op": "host_call", "name", "args", "kwargs"}   a host function's call (the cell's "host":
    sup -> cell  {"op": "host_result", "ok", "value"|"error"}    its names, calls_max, bytes_max), answered
                                                                 by the worker, or refused by the supervisor
                                                                 (one at a time, at most calls_max)
"""

from __future__ import annotations

import json
import os

TYPE_CHECKING = False  # typing is not imported in the jail: no module a fresh interpreter lacks
if TYPE_CHECKING:
    from typing import Any, Final

#: The control socket's fd number in the jail (nsjail passes it through under the same number).
CTL_FD: Final = 3
#: The first fd above a child's standard streams (a child keeps fds 0-2 only).
FIRST_UNSTD_FD: Final = 3
#: Largest control message, either way.
MAX_MSG: Final = 65536
#: Most fds one message carries.
MAX_FDS: Final = 16
#: Size of a call's report and setup memfds. The setup memfd's last byte is the "started" mark.
REPORT_BYTES: Final = 64 << 10
#: The "started" mark's value.
STARTED_MARK: Final = b"\x01"
#: How long a freshly forked child waits for the worker's "go" (its OOM score raised).
GO_TIMEOUT_S: Final = 10
#: Where fetched files' contents start in the fetch-out memfd (a JSON index comes first).
FETCH_DATA_AT: Final = 256 << 10
#: Exit code of a child whose setup (before user code) failed; the setup memfd says why.
SETUP_FAILED: Final = 125


class Ctl:
    """Op names of the control socket."""

    HELLO: Final = "hello"
    RUN: Final = "run"
    FORKED: Final = "forked"
    GO: Final = "go"
    KILL: Final = "kill"
    EXITED: Final = "exited"
    READY: Final = "ready"
    RENEW: Final = "renew"
    PING: Final = "ping"
    PONG: Final = "pong"
    CREATE: Final = "create"
    CREATED: Final = "created"
    END: Final = "end"
    ENDED: Final = "ended"


class Judge:
    """Op names of a judged call's channel."""

    PREPARED: Final = "prepared"
    TEST: Final = "test"
    KILL: Final = Ctl.KILL
    DONE: Final = "done"


class Family:
    """Op names of a family's socket."""

    GO: Final = Ctl.GO
    READY: Final = Ctl.READY
    CELL: Final = "cell"
    CELL_STARTED: Final = "cell_started"
    CELL_OVER: Final = "cell_over"
    RESUME: Final = "resume"
    CELL_DONE: Final = "cell_done"
    KILL: Final = Ctl.KILL
    FORK: Final = "fork"
    FORKED: Final = Ctl.FORKED
    CLOSE: Final = "close"
    CLOSED: Final = "closed"
    PING: Final = Ctl.PING
    PONG: Final = Ctl.PONG
    HOST_CALL: Final = "host_call"
    HOST_RESULT: Final = "host_result"


class Session:
    """Op names between a family's supervisor and a session's process."""

    CELL: Final = Family.CELL
    REAPED: Final = "reaped"
    FORK: Final = Family.FORK
    REAP: Final = "reap"
    HELLO: Final = Ctl.HELLO


class Cell:
    """Op names a cell's process sends its supervisor."""

    STARTED: Final = "started"
    GO: Final = Ctl.GO
    DONE: Final = Judge.DONE
    HOST_CALL: Final = Family.HOST_CALL
    HOST_RESULT: Final = Family.HOST_RESULT


#: Every op name of every channel (a test keeps them out of every other module as literals).
OPS: Final = frozenset(
    value for channel in (Ctl, Judge, Family, Session, Cell)
    for name, value in vars(channel).items() if name.isupper()
)


class CallFd:
    """Positions of a call's fds in its "run" message (SCM_RIGHTS); a judged test's and a cell's too."""

    CODE, STDIN, STDOUT, STDERR, REPORT, SETUP = range(6)
    FILES_IN, FETCH_LIST, FETCH_OUT = range(6, 9)  # only when the call has files in or out
    JUDGE = 6  # a judged call: the socket of the worker's judge channel
    PLAIN = 6  # a call without files, a judged test, a cell
    WITH_FILES = 9
    COUNTS = (PLAIN, JUDGE + 1, WITH_FILES)  # a call sends one of these many fds

    @staticmethod
    def fits(msg: dict[str, Any], count: int) -> bool:
        """Whether `count` fds is what a call like `msg` sends."""
        if msg.get("judge") in JUDGE_SERVED:
            return count == CallFd.JUDGE + 1
        return count in (CallFd.PLAIN, CallFd.WITH_FILES)


class CellFd:
    """A cell's fds from its supervisor to the session's process: a call's 6, then the cell channel."""

    CHANNEL = CallFd.PLAIN
    COUNT = CHANNEL + 1


#: Fds of a "create" (the family socket) and of a session "fork" (the new session's channel).
ONE_FD: Final = 1

#: Judged calls served by a submission's process (a judge channel); "function_single" is one
#: function-call test run as a plain call (its arguments in the stdin memfd, its value reported).
JUDGE_SERVED: Final = ("stdin", "function", "function_inline", "binary")
#: A compiled program (static, in the code memfd): each test execs it with stdin.
JUDGE_BINARY: Final = "binary"
JUDGE_FUNCTION: Final = "function"
JUDGE_FUNCTION_INLINE: Final = "function_inline"
JUDGE_FUNCTION_SINGLE: Final = "function_single"
JUDGE_STDIN: Final = "stdin"


def encode(msg: dict[str, Any]) -> bytes:
    """A message as it goes on a socket."""
    return json.dumps(msg, separators=(",", ":")).encode()


def decode(data: bytes) -> dict[str, Any] | None:
    """A message from the other end, or None if it is not a JSON object."""
    try:
        msg = json.loads(data)
    except (ValueError, RecursionError):
        return None
    return msg if isinstance(msg, dict) else None


def frame(obj: object, limit: int | None = None) -> bytes:
    """Length-prefixed JSON, the one framing of the protocol's memfds: a 4-byte little-endian length,
    then the JSON, cut to `limit` bytes in all (a cut frame does not parse, and reads as nothing)."""
    data = json.dumps(obj, ensure_ascii=True, separators=(",", ":")).encode()
    if limit is not None:
        data = data[: limit - 4]
    return len(data).to_bytes(4, "little") + data


def unframe(buf: bytes, limit: int) -> tuple[object, int]:
    """(the object, the offset after it) of the frame at the start of `buf`; ValueError unless it is
    a whole frame of at most `limit` bytes."""
    size = int.from_bytes(bytes(buf[:4]), "little")
    if len(buf) < 4 or not 0 < size <= limit - 4 or 4 + size > len(buf):
        raise ValueError(f"no frame of at most {limit} bytes")
    return json.loads(bytes(buf[4 : 4 + size])), 4 + size


def read_frame(fd: int, limit: int) -> object:
    """The object of the frame at the start of the memfd `fd` (ValueError if there is none)."""
    size = int.from_bytes(os.pread(fd, 4, 0), "little")
    if not 0 < size <= limit - 4:
        raise ValueError(f"no frame of at most {limit} bytes")
    return unframe(os.pread(fd, 4 + size, 0), limit)[0]
