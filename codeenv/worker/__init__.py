"""Workers that drain a distributed queue into a local slot pool."""

from codeenv.worker.redis import StreamWorker

__all__ = ["StreamWorker"]
