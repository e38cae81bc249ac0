"""Queues between the gateway and the slot pools: one interface, one module per backend."""

from codeenv.queue.base import CallQueue
from codeenv.queue.embedded import EmbeddedQueue

__all__ = ["CallQueue", "EmbeddedQueue"]
