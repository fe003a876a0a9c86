"""Celery tasks of the API's stored objects: the Responses API's responses
(:mod:`api.response_store`), the Files API's files (:mod:`api.file_store`) and the Batch API's
batches (:mod:`api.batch_runner`)."""

from __future__ import annotations

from celery import shared_task

from api import batch_runner, file_store, response_store
from gateway.background import run_niced
from gateway.conf import platform_settings

PURGE_TASK = "api.tasks.purge_responses"
BATCH_STEP_TASK = "api.tasks.advance_batches"
PURGE_FILES_TASK = "api.tasks.purge_files"


@shared_task(name=PURGE_TASK, ignore_result=True)
def purge_responses() -> int:
    """Delete the stored responses past ``RESPONSES_RETENTION_S`` (periodic); returns how many."""
    return response_store.purge()


def end_orphaned_responses(**_: object) -> int:
    """End the stored responses whose web process died mid-answer, and give those that ended
    without usage their billed usage: a receiver of :data:`gateway.tasks.swept`, so it runs with
    each round of the queue sweep."""
    return response_store.end_orphans() + response_store.fill_billed_usage()


@shared_task(name=PURGE_FILES_TASK, ignore_result=True)
def purge_files() -> int:
    """Delete the files past their ``expires_at``, rows and stored bytes (periodic); returns how
    many."""
    return file_store.purge()


@shared_task(name=BATCH_STEP_TASK, ignore_result=True, expires=30)
def advance_batches() -> int:
    """One step of every active batch (periodic, every ``BATCH_STEP_INTERVAL_S``; each step is
    bounded by ``BATCH_STEP_BUDGET_S``), at nice ``BATCH_STEP_NICE`` (:mod:`gateway.background`:
    batch work yields the CPU to the engine and the web tier); returns how many batches were
    stepped."""
    return run_niced(batch_runner.advance_all, platform_settings()["BATCH_STEP_NICE"])
