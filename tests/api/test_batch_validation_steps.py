"""A batch's validation is spread over steps by their time (:func:`api.batch_lines.read_some`):
a step reads lines until its time is spent, the next goes on where it stopped, and the file ends
read whole, each line once."""

from __future__ import annotations

from api import batch_lines, batch_runner
from api.models import Batch, BatchLine
from tests.api.test_batches_api import create_batch, line
from tests.api.test_files_api import files_root  # noqa: F401 - the test's own files folder
from tests.api.test_nullable_fields import in_process


def test_a_step_whose_time_is_spent_reads_a_share_and_the_next_goes_on(settings, monkeypatch,
                                                                       tenant_key):
    tenant, key, raw = tenant_key
    count = 2 * batch_lines.MIN_READ + 50
    lines = [line(f"r{i}", f"Question {i}?") for i in range(count)]
    lines[batch_lines.MIN_READ + 7]["method"] = "GET"  # one refused, in the second share
    made = in_process(raw, lambda client: create_batch(client, lines))
    settings.LLM_PLATFORM = {**settings.LLM_PLATFORM, "BATCH_STEP_BUDGET_S": 0.0}
    monkeypatch.setattr(batch_runner, "MIN_SHARE_S", 0.0)
    read = []
    for _ in range(3):
        batch_runner.advance_all()
        row = Batch.objects.get(pk=made.id)
        read.append((row.status, BatchLine.objects.filter(batch=row).count()))
    assert read == [("validating", 100), ("validating", 200), ("in_progress", count)]
    assert row.total == count
    ids = list(BatchLine.objects.filter(batch=row).order_by("index")
               .values_list("custom_id", flat=True))
    assert ids == [f"r{i}" for i in range(count)]
    failed = BatchLine.objects.get(batch=row, state="failed")
    assert failed.custom_id == f"r{batch_lines.MIN_READ + 7}"
    assert failed.result["response"]["body"]["error"]["param"] == "method"


def test_without_a_time_bound_a_step_reads_its_whole_count(settings, tenant_key):
    tenant, key, raw = tenant_key
    count = 2 * batch_lines.MIN_READ + 50
    made = in_process(raw, lambda client: create_batch(
        client, [line(f"r{i}", f"Question {i}?") for i in range(count)]))
    batch_runner.advance_all()  # the default budget reads 250 lines in far less than its time
    row = Batch.objects.get(pk=made.id)
    assert (row.status, row.total) == ("in_progress", count)
