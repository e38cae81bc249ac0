"""Logging of the service's processes: one format per run, for codeenv's own loggers and uvicorn's.

Usage::

    setup("json")                         # or "plain"; CODEENV_LOG_FORMAT picks it for every command
    uvicorn.run(app, log_config=None)     # uvicorn then logs through the root logger set up here

Every line a process writes to stderr through logging is one JSON object (`json`) or one plain
line (`plain`), never a mix of both: uvicorn's startup lines (`uvicorn.error`) and its access log,
one line per request (`uvicorn.access`), go through the same handler as codeenv's own lines, and
so do Python's warnings. One record is one line in either format (a plain traceback's line breaks
are written as a literal backslash-n).
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Literal, get_args

LogFormat = Literal["json", "plain"]
FORMATS: tuple[str, ...] = get_args(LogFormat)
#: The variable that picks the format; `serve --processes N` passes it on to every process it starts.
ENV = "CODEENV_LOG_FORMAT"
PLAIN = "%(asctime)s %(levelname)s %(name)s: %(message)s"
#: uvicorn's loggers: they propagate to the root logger, with no handler of their own.
UVICORN_LOGGERS = ("uvicorn", "uvicorn.error", "uvicorn.access", "uvicorn.asgi")


def parse(value: str) -> LogFormat:
    """A format's name (``text`` is the older name of ``plain``); ValueError names the choices."""
    name = value.strip().lower()
    name = "plain" if name == "text" else name
    if name not in FORMATS:
        raise ValueError(f"{ENV}={value!r}: choose json or plain")
    return name  # type: ignore[return-value]


def from_env(default: LogFormat = "json") -> LogFormat:
    """The format CODEENV_LOG_FORMAT names, else `default`."""
    value = os.environ.get(ENV)
    return parse(value) if value else default


class OneLineFormatter(logging.Formatter):
    """The plain format, one line per record: a traceback's or a warning's line breaks become a
    literal backslash-n, so that every line of the log is a record of its own."""

    def format(self, record: logging.LogRecord) -> str:
        return super().format(record).replace("\n", "\\n")


class _AccessFields(logging.Filter):
    """Gives uvicorn's records fields of their own: the access log's client, method, path and status
    (JSON lines get them as keys), and drops uvicorn's coloured copy of the message."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.__dict__.pop("color_message", None)
        if record.name == "uvicorn.access" and isinstance(record.args, tuple) and len(record.args) == 5:
            client, method, path, _version, status = record.args
            record.__dict__.update(event="request", client=client, method=method, path=path, status=status)
        return True


def setup(log_format: LogFormat, level: int = logging.INFO) -> None:
    """Route every logger of this process (codeenv's, uvicorn's, warnings) to one stderr handler
    in `log_format`, and remember the choice for processes started from this one."""
    handler = logging.StreamHandler(sys.stderr)
    if log_format == "json":
        from pythonjsonlogger.json import JsonFormatter

        handler.setFormatter(JsonFormatter("%(asctime)s %(levelname)s %(name)s %(message)s",
                                           rename_fields={"levelname": "level", "name": "logger"}))
    else:
        handler.setFormatter(OneLineFormatter(PLAIN))
    handler.addFilter(_AccessFields())
    logging.basicConfig(level=level, handlers=[handler], force=True)
    for name in UVICORN_LOGGERS:
        uvicorn_logger = logging.getLogger(name)
        uvicorn_logger.handlers.clear()
        uvicorn_logger.propagate = True
    logging.captureWarnings(True)
    os.environ[ENV] = log_format
