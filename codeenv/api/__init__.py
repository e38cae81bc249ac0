"""The HTTP gateway (FastAPI)."""

from codeenv.api.app import create_app

__all__ = ["create_app"]
