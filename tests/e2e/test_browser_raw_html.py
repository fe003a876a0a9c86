"""In a real browser (headless Debian Chromium, Selenium) against the real processes: raw HTML in
an answer shows as the text it is, and hides nothing after it.

An element the sanitizer drops whole (``<svg>``, ``<math>``, ``<template>``, ...) or one that
swallows what follows (``<textarea>``, ``<title>``, ``<!--``, an unclosed tag) would take the
rest of the answer with it. Each tag must show literally, the Markdown around it render (lists,
emphasis, code blocks) and everything after it be visible: in a stored answer (a reload, the
conversation's history) and in one streamed live; the stored text stays the answer's own.
"""

from __future__ import annotations

import time
import uuid

import pytest
import redis

from tests.e2e.test_browser import (  # noqa: F401 - the browser tests' fixtures
    browser,
    sign_in,
    stack,
    staff_member,
)
from tests.support.e2e import wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

TAGS = ["<svg>", "<math>", "<template>", "<script>", "<style>", "<textarea>", "<iframe>",
        "<!--", "<title>", "<noscript>", "<xmp>", "<plaintext>", "<select>", "<object>",
        "<table>", '<div class="x"', "<b>", "</p>", "<![CDATA[", "<?xml"]


def answer_with(tag: str) -> str:
    return (f"Before {tag} after it, with **bold** text.\n"
            f"{tag}\n"
            "A line after the tag alone.\n\n"
            "- a list item\n"
            "- an item with `inline code`\n\n"
            "```python\nprint('a code block')\n```\n\n"
            "The end of the answer.")


def assert_shown_in_full(body, tag: str) -> None:
    """The rendered answer of :func:`answer_with`: the tag as text, all that follows visible."""
    from selenium.webdriver.common.by import By

    text = body.text  # the text a user sees (hidden text is not in it)
    assert f"Before {tag} after it, with bold text." in text, (tag, text)
    assert f"{tag}\nA line after the tag alone." in text, (tag, text)
    assert body.find_element(By.CSS_SELECTOR, "strong").text == "bold", tag
    items = [li.text for li in body.find_elements(By.CSS_SELECTOR, "ul > li")]
    assert items == ["a list item", "an item with inline code"], (tag, items)
    assert body.find_element(By.CSS_SELECTOR, "li code").text == "inline code", tag
    assert body.find_element(By.CSS_SELECTOR, "pre code").text == "print('a code block')", tag
    end = body.find_elements(By.CSS_SELECTOR, "p")[-1]
    assert end.text == "The end of the answer." and end.is_displayed(), tag
    # Nothing but Markdown's own elements came out of it.
    made = {e.tag_name for e in body.find_elements(By.CSS_SELECTOR, "*")}
    assert made <= {"p", "br", "strong", "ul", "li", "code", "pre"}, (tag, made)


def test_raw_html_in_stored_answers_shows_as_text(
        stack, browser, staff_member):  # noqa: F811 - imported fixtures
    from selenium.webdriver.common.by import By

    from chat.models import Conversation, Message

    sign_in(browser, stack)
    conversation = Conversation.objects.create(user=staff_member,
                                               tenant=staff_member.membership.tenant,
                                               title="raw html")
    answers = {}
    for tag in TAGS:
        Message.objects.create(conversation=conversation, role="user", content=f"show {tag}")
        answers[tag] = Message.objects.create(conversation=conversation, role="assistant",
                                              content=answer_with(tag))
    browser.get(f"{stack.url}/chat/c/{conversation.pk}/")
    assert wait_for(lambda: len(browser.find_elements(By.CSS_SELECTOR,
                                                      ".message.assistant .body")) == len(TAGS),
                    10)
    bodies = browser.find_elements(By.CSS_SELECTOR, ".message.assistant .body")
    for tag, body in zip(TAGS, bodies, strict=True):
        assert_shown_in_full(body, tag)
    # The user's own messages show as typed.
    users = [u.text for u in browser.find_elements(By.CSS_SELECTOR, ".message.user .body")]
    assert users == [f"show {tag}" for tag in TAGS]
    for tag, message in answers.items():  # rendering changed nothing stored
        message.refresh_from_db()
        assert message.content == answer_with(tag)


def test_raw_html_in_an_answer_streamed_live_shows_as_text(
        stack, browser, staff_member):  # noqa: F811 - imported fixtures
    """An answer being written (the page follows it from the worker's event stream, token by
    token, a tag cut across tokens): shown as text while it streams and once it ends, and
    stored as generated."""
    from selenium.webdriver.common.by import By

    from chat.models import Conversation, Message
    from inference.protocol.events import (
        FinalEvent,
        FinishReason,
        TokenEvent,
        Usage,
        encode_event,
    )
    from inference.protocol.keys import Keys

    text = "\n\n".join(answer_with(tag) for tag in ("<svg>", "<template>", "<!--"))
    pieces = [text[i:i + 3] for i in range(0, len(text), 3)]  # "<sv", "g> a", ...
    request_id = f"raw-html-{uuid.uuid4().hex[:8]}"
    sign_in(browser, stack)
    conversation = Conversation.objects.create(user=staff_member,
                                               tenant=staff_member.membership.tenant,
                                               title="raw html live")
    Message.objects.create(conversation=conversation, role="user", content="show tags")
    message = Message.objects.create(conversation=conversation, role="assistant",
                                     status="streaming", request_id=request_id)
    events = Keys(stack.prefix).events(request_id)
    client = redis.Redis.from_url(stack.env["REDIS_URL"])

    def write(seqs: range) -> None:
        for seq in seqs:
            client.xadd(events, encode_event(TokenEvent(request_id=request_id, seq=seq,
                                                        token_id=0, text=pieces[seq])))

    half = len(pieces) // 2
    write(range(0, half))  # written before the page opened, as a worker had
    browser.get(f"{stack.url}/chat/c/{conversation.pk}/")

    def shown() -> str:
        nodes = browser.find_elements(By.CSS_SELECTOR, ".message.assistant .body")
        return nodes[-1].text if nodes else ""

    # The first half, shown while the answer is still being written.
    assert wait_for(lambda: "<svg>\nA line after the tag alone." in shown(), 10), shown()
    node = browser.find_elements(By.CSS_SELECTOR, ".message.assistant")[-1]
    assert node.get_attribute("data-status") == "streaming"
    for seq in range(half, len(pieces)):  # the rest live, as a worker writes it
        write(range(seq, seq + 1))
        time.sleep(0.005)
    client.xadd(events, encode_event(FinalEvent(
        request_id=request_id, seq=len(pieces), finish_reason=FinishReason.STOP,
        usage=Usage(prompt_tokens=3, completion_tokens=len(pieces)))))
    assert wait_for(lambda: node.get_attribute("data-status") == "complete", 15)
    body = node.find_element(By.CSS_SELECTOR, ".body")
    for tag in ("<svg>", "<template>", "<!--"):
        assert f"Before {tag} after it, with bold text." in body.text, (tag, body.text)
        assert f"{tag}\nA line after the tag alone." in body.text, (tag, body.text)
    assert body.text.endswith("The end of the answer.")
    assert len(body.find_elements(By.CSS_SELECTOR, "pre code")) == 3
    assert wait_for(lambda: Message.objects.get(pk=message.pk).status == "complete", 10)
    assert Message.objects.get(pk=message.pk).content == text
    # Shown the same when the page loads it from the history.
    streamed = body.text
    browser.refresh()
    again = wait_for(lambda: browser.find_elements(By.CSS_SELECTOR, ".message.assistant .body"),
                     10)[-1]
    assert again.text == streamed
