"""The dashboard while its database cannot serve: its data answers a JSON 503, and a stats
snapshot the database refuses is skipped (the chart has a gap), logged once, not raised."""

from __future__ import annotations

import logging

import pytest
from django.test import Client

from dashboard import tasks
from dashboard.models import StatsSnapshot
from tenants.best_effort import OccasionalLog
from tests.support import database

database_fault = database.database_fault  # the fixture


def test_the_dashboard_data_answers_503_json(admin_user, database_fault):
    client = Client(raise_request_exception=False)
    client.force_login(admin_user)
    assert client.get("/admin/scheduler/data").status_code == 200
    database_fault.down()  # the staff check cannot read the session
    response = client.get("/admin/scheduler/data")
    assert response.status_code == 503 and response["Retry-After"] == "1"
    assert response["Content-Type"] == "application/json"
    error = response.json()["error"]
    assert error["code"] == "service_unavailable" and "database" in error["message"]


@pytest.mark.parametrize("fault", ["down", "read_only"])
def test_a_snapshot_the_database_refuses_is_skipped_and_logged_once(database_fault, caplog,
                                                                    monkeypatch, fault):
    refusals = tasks.SNAPSHOT_WRITE.refusals
    monkeypatch.setattr(tasks.SNAPSHOT_WRITE, "refusals", OccasionalLog(refusals.logger))
    getattr(database_fault, fault)()
    with caplog.at_level(logging.WARNING, logger="tenants.best_effort"):
        assert [tasks.snapshot_stats() for _ in range(3)] == [None, None, None]
    assert len([r for r in caplog.records if "stats snapshot" in r.getMessage()]) == 1
    database_fault.restore()
    assert StatsSnapshot.objects.filter(pk=tasks.snapshot_stats()).exists()
