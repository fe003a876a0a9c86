"""The Django project: settings from the environment, URL routes, ASGI routing, the Celery app."""

from llm_platform.celery import app as celery_app

__all__ = ["celery_app"]
