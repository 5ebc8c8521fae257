"""The router's OpenAI-compatible HTTP API."""

from services.router.api.app import ApiConfig, create_app

__all__ = ["ApiConfig", "create_app"]
