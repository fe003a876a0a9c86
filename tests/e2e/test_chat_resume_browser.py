"""In a real browser against the real processes (daphne, a reference-backend worker, Celery,
Redis, the database): a chat answer survives a reload of the page and a kill -9 and restart of
the web process mid-answer. The page says it is reconnecting, takes the answer up again in place,
and ends with the text of an uninterrupted run of the same turn, which is also what is stored.
"""

from __future__ import annotations

import time

import pytest

from tests.e2e.test_browser import browser  # noqa: F401 - the fixture (skips without chromium)
from tests.support.e2e import start_stack, wait_for
from tests.support.web import PASSWORD

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

PROMPT = "Tell me a long story about the sea."
ANSWER_TOKENS = 160
STEP_S = 0.025  # a worker's forward pass: an answer takes ANSWER_TOKENS * STEP_S


@pytest.fixture(scope="module")
def stack(request, django_db_setup, django_db_blocker, tmp_path_factory):
    return start_stack(request, django_db_blocker, tmp_path_factory, workers=1,
                       BACKEND="reference", REFERENCE_STEP_DELAY_S=STEP_S,
                       CHAT_MAX_TOKENS=ANSWER_TOKENS, CHAT_TEMPERATURE=0, MAX_BATCH_SIZE=4)


def test_an_answer_survives_a_reload_and_a_web_process_restart(stack, browser,  # noqa: F811
                                                               make_member, transactional_db):
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.common.by import By

    from chat.models import Message

    make_member(username="bea")
    browser.get(f"{stack.url}/chat/login/")
    browser.find_element(By.ID, "id_username").send_keys("bea")
    browser.find_element(By.ID, "id_password").send_keys(PASSWORD)
    browser.find_element(By.CSS_SELECTOR, "button[type=submit]").click()

    def connection() -> str:
        return browser.find_element(By.ID, "connection").text

    def answer() -> tuple[str, str]:
        """The last answer on the page: (its status, its text)."""
        try:
            nodes = browser.find_elements(By.CSS_SELECTOR, ".message.assistant")
            if not nodes:
                return "", ""
            return (nodes[-1].get_attribute("data-status"),
                    nodes[-1].find_element(By.CSS_SELECTOR, ".body").text)
        except StaleElementReferenceException:  # re-rendered (or the page reloaded) meanwhile
            return "", ""

    def ask_in_a_new_conversation() -> None:
        browser.get(f"{stack.url}/chat/")
        assert wait_for(lambda: connection() == "connected", 10)
        browser.find_element(By.ID, "prompt").send_keys(PROMPT)
        browser.find_element(By.ID, "send").click()

    def finished(timeout_s: float) -> str:
        assert wait_for(lambda: answer()[0] not in ("", "streaming"), timeout_s), answer()
        status, text = answer()
        assert status == "complete"
        return text

    ask_in_a_new_conversation()
    expected = finished(30)
    assert len(expected) > 100

    # A reload mid-answer: the page shows the answer still streaming, and its end in place.
    ask_in_a_new_conversation()
    assert wait_for(lambda: len(answer()[1]) >= 10, 10)
    browser.refresh()
    assert wait_for(lambda: answer()[0] == "streaming" and answer()[1], 10)
    seen = len(answer()[1])
    assert wait_for(lambda: answer()[0] != "streaming" or len(answer()[1]) > seen, 10)
    assert finished(30) == expected

    # The web process dies mid-answer and comes back: the page reconnects by itself.
    ask_in_a_new_conversation()
    assert wait_for(lambda: len(answer()[1]) >= 20, 10)
    stack.kill("daphne")
    assert wait_for(lambda: connection() == "reconnecting…", 10)
    assert browser.find_elements(By.CSS_SELECTOR, ".message.assistant .badge.reconnecting")
    time.sleep(1.0)  # still away for a while: the generation goes on meanwhile
    stack.restart("daphne")
    assert finished(60) == expected
    assert connection() == "connected"
    assert not browser.find_elements(By.CSS_SELECTOR, ".badge.reconnecting")
    # Stored three times the same (the page shows it as HTML: its runs of spaces collapse).
    stored = list(Message.objects.filter(role="assistant").values_list("status", "content"))
    assert len(stored) == 3 and len(set(stored)) == 1 and stored[0][0] == "complete"
    assert " ".join(stored[0][1].split()) == " ".join(expected.split())
