"""In a real browser (headless Debian Chromium, Selenium) against the real processes: daphne, an
inference worker (the real model when prepared, else the reference backend), Celery with beat,
Redis and the database.

Screenshots of the chat page and the dashboard are saved under ``artifacts/``.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import threading
import time
from pathlib import Path

import pytest
import redis

from tests.support.e2e import MODEL, client, start_stack, wait_for
from tests.support.web import PASSWORD

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
ARTIFACTS = REPO / "artifacts"
CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
BROWSER_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                "--disable-component-update", "--disable-sync", "--no-first-run",
                "--disable-dev-shm-usage", "--window-size=1280,900"]

if not (shutil.which(CHROMIUM) and shutil.which(CHROMEDRIVER)):
    if os.environ.get("CI"):  # CI installs them (scripts/test.sh): never pass by skipping there
        raise RuntimeError("chromium and chromium-driver are missing")
    pytest.skip("needs Debian's chromium and chromium-driver (apt-get install chromium "
                "chromium-driver)", allow_module_level=True)


def model_prepared() -> bool:
    from inference.protocol.settings import PlatformSettings

    return (PlatformSettings().model_folder / "config.json").is_file()


@pytest.fixture(scope="module")
def stack(request, django_db_setup, django_db_blocker, tmp_path_factory):
    backend = "transformers" if model_prepared() else "reference"
    stack = start_stack(request, django_db_blocker, tmp_path_factory, workers=1,
                        BACKEND=backend, CHAT_MAX_TOKENS=400, STATS_SNAPSHOT_INTERVAL_S=1,
                        MAX_BATCH_SIZE=8)
    bin_dir = Path(sys.executable).parent
    # Celery beat, as the run command starts it: the dashboard's snapshots.
    stack.others.append(stack._spawn("beat", [
        str(bin_dir / "celery"), "-A", "llm_platform", "beat", "-l", "info",
        "-s", str(stack.log_dir / "beat-schedule")]))
    stack.backend = backend
    return stack


@pytest.fixture(scope="module")
def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in BROWSER_ARGS:
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.implicitly_wait(0)
    ARTIFACTS.mkdir(exist_ok=True)
    yield driver
    driver.quit()


@pytest.fixture
def staff_member(make_member, transactional_db):
    return make_member(username="ada", is_staff=True, is_superuser=True)


def worker_stats(stack) -> dict:
    client = redis.Redis.from_url(stack.env["REDIS_URL"])
    raw = [client.get(k) for k in client.scan_iter(f"{stack.prefix}:stats:*")]
    snaps = [json.loads(r) for r in raw if r]
    return {"num_active": sum(s["num_active"] for s in snaps),
            "active_kv_reserved": sum(s["active_kv_reserved"] for s in snaps)}


def sign_in(browser, stack) -> None:
    from selenium.webdriver.common.by import By

    browser.get(f"{stack.url}/chat/login/")
    browser.find_element(By.ID, "id_username").send_keys("ada")
    browser.find_element(By.ID, "id_password").send_keys(PASSWORD)
    browser.find_element(By.CSS_SELECTOR, "button[type=submit]").click()
    wait_for(lambda: "/chat/" in browser.current_url and "login" not in browser.current_url, 10)


def test_chat_streams_stops_and_keeps_the_history(stack, browser, staff_member):
    from selenium.webdriver.common.by import By

    sign_in(browser, stack)
    assert wait_for(lambda: browser.find_element(By.ID, "connection").text == "connected", 10)
    prompt = browser.find_element(By.ID, "prompt")
    prompt.send_keys("Write a long story about a dragon who learns to cook, in ten chapters.")
    browser.find_element(By.ID, "send").click()

    def answer_text() -> str:
        nodes = browser.find_elements(By.CSS_SELECTOR, ".message.assistant .body")
        return nodes[-1].text if nodes else ""

    lengths: list[int] = []
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        n = len(answer_text())
        if n and (not lengths or n != lengths[-1]):
            lengths.append(n)
        if len(lengths) >= 4 and n >= 40:
            break
        time.sleep(0.05)
    assert len(lengths) >= 4, f"the answer did not stream in steps: {lengths}"
    assert wait_for(lambda: worker_stats(stack)["num_active"] >= 1, 5)

    browser.find_element(By.ID, "stop").click()
    badge = wait_for(lambda: browser.find_elements(By.CSS_SELECTOR,
                                                   ".message.assistant .badge.stopped"), 15)
    assert badge and badge[0].text == "Stopped"
    assert wait_for(lambda: worker_stats(stack) == {"num_active": 0, "active_kv_reserved": 0},
                    10)
    stopped_text = answer_text()
    time.sleep(1.0)  # nothing may arrive after Stop: an absence needs a window to show
    assert answer_text() == stopped_text  # generation really ended
    assert browser.find_element(By.ID, "send").is_enabled()
    browser.save_screenshot(str(ARTIFACTS / "chat.png"))

    # The conversation got its own URL; a reload shows the stored history.
    assert wait_for(lambda: "/chat/c/" in browser.current_url, 5)
    browser.refresh()
    wait_for(lambda: browser.find_elements(By.CSS_SELECTOR, ".message.assistant"), 10)
    users = browser.find_elements(By.CSS_SELECTOR, ".message.user")
    assistants = browser.find_elements(By.CSS_SELECTOR, ".message.assistant")
    assert users[-1].text.startswith("Write a long story about a dragon")
    assert assistants[-1].find_element(By.CSS_SELECTOR, ".badge.stopped").text == "Stopped"
    assert assistants[-1].find_element(By.CSS_SELECTOR, ".body").text.strip() == \
        stopped_text.strip()
    sidebar = browser.find_elements(By.CSS_SELECTOR, "#conversation-list li.current a")
    assert sidebar and sidebar[0].text.startswith("Write a long story")


def test_markdown_is_rendered_and_script_never_runs(stack, browser, staff_member):
    """Stored answers go through marked and DOMPurify: code blocks render, script does not."""
    from selenium.webdriver.common.by import By

    from chat.models import Conversation, Message

    sign_in(browser, stack)
    conversation = Conversation.objects.create(user=staff_member,
                                               tenant=staff_member.membership.tenant,
                                               title="markdown")
    Message.objects.create(conversation=conversation, role="user", content="show me")
    Message.objects.create(
        conversation=conversation, role="assistant",
        content="# Title\n\n```python\nprint('hi')\n```\n\n<img src=x onerror=\"window.pwned=1\">"
                "<script>window.pwned=2</script> **bold**")
    browser.get(f"{stack.url}/chat/c/{conversation.pk}/")
    body = wait_for(lambda: browser.find_elements(By.CSS_SELECTOR, ".message.assistant .body"),
                    10)[0]
    assert body.find_element(By.CSS_SELECTOR, "h1").text == "Title"
    assert body.find_element(By.CSS_SELECTOR, "pre code").text == "print('hi')"
    assert body.find_element(By.CSS_SELECTOR, "strong").text == "bold"
    assert not body.find_elements(By.CSS_SELECTOR, "script")
    assert browser.execute_script("return window.pwned") is None


def test_dashboard_numbers_move_while_a_load_runs(stack, browser, staff_member, make_tenant):
    from selenium.webdriver.common.by import By

    from dashboard.models import StatsSnapshot

    sign_in(browser, stack)
    browser.get(f"{stack.url}/admin/")
    browser.find_element(By.LINK_TEXT, "Scheduler dashboard").click()
    assert wait_for(lambda: browser.find_element(By.ID, "dash-workers").text == "1", 15)

    def number(name: str) -> str:
        return browser.find_element(By.ID, f"m-{name}").text

    seen: dict[str, set[str]] = {n: set() for n in ("num_active", "active_kv_reserved",
                                                    "kv_pressure", "tokens_per_s")}
    raw_key = make_tenant(name="Load")[2]
    api = client(stack, raw_key)
    max_tokens = 48 if stack.backend == "transformers" else 2000

    stop = threading.Event()

    def one(i: int) -> None:
        # Requests one after another until the page has seen the load move (a fast machine
        # finishes one round of them between two polls of the page).
        while not stop.is_set():
            api.chat.completions.create(model=MODEL, max_tokens=max_tokens, temperature=0,
                                        messages=[{"role": "user", "content": f"Count to {i}."}])

    def moved() -> bool:
        return (len(seen["num_active"] - {"0", "–"}) >= 1 and len(seen["num_active"]) >= 2
                and len(seen["active_kv_reserved"]) >= 2
                and any(v not in ("–", "0.0") for v in seen["tokens_per_s"]))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 120
    shot = False
    browser.set_window_size(1280, 1500)
    try:
        while time.monotonic() < deadline and not moved():
            for name in seen:
                seen[name].add(number(name))
            if not shot and number("num_active") not in ("0", "–") and len(seen["num_active"]) > 2:
                browser.save_screenshot(str(ARTIFACTS / "dashboard.png"))  # under load
                shot = True
            time.sleep(0.2)
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    # The page's next polls show the load gone.
    assert wait_for(lambda: number("num_active") == "0", 15)
    for name in seen:
        seen[name].add(number(name))
    assert len(seen["num_active"]) >= 2, seen
    assert len(seen["active_kv_reserved"]) >= 2, seen
    assert any(v not in ("–", "0.0") for v in seen["tokens_per_s"]), seen
    rows = browser.find_elements(By.CSS_SELECTOR, "#per-key tbody tr[data-key]")
    assert "load" in [r.get_attribute("data-key") for r in rows]
    # The table per base model: the one model served, its one worker, its tokens generated.
    [model_row] = browser.find_elements(By.CSS_SELECTOR, "#per-model tbody tr[data-model]")
    cells = [c.text for c in model_row.find_elements(By.TAG_NAME, "td")]
    assert cells[0] == MODEL and cells[1] == "1" and cells[6] not in ("0", "")
    assert StatsSnapshot.objects.filter(num_active__gt=0).exists()
    assert len(browser.find_elements(By.CSS_SELECTOR, ".uplot")) == 5
    if not shot:
        browser.save_screenshot(str(ARTIFACTS / "dashboard.png"))
    browser.set_window_size(1280, 900)
