"""Workers that drain a distributed queue into a local slot pool."""

from codeenv.worker.streams import StreamWorker

__all__ = ["StreamWorker"]
