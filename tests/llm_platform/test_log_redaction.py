"""A key in a log line is cut to the prefix the admin shows, wherever it is in the record."""

from __future__ import annotations

import io
import logging

from llm_platform.log_redaction import RedactingAccessLog, RedactKeys, redact
from tenants.services import VISIBLE_PREFIX_LEN, generate_raw_key


def test_a_key_is_cut_to_its_visible_prefix():
    key = generate_raw_key()
    assert redact(f"GET /v1/models?api_key={key}&x=1") == (
        f"GET /v1/models?api_key={key[:VISIBLE_PREFIX_LEN]}…&x=1")
    assert redact("nothing secret: sk-short") == "nothing secret: sk-short"


def test_a_percent_encoded_key_is_a_key():
    """A URL may spell any of a key's characters as %XX, which the server decodes."""
    from urllib.parse import quote, unquote

    key = generate_raw_key()
    for spelled in (key.replace("-", "%2D"), "".join(f"%{b:02X}" for b in key.encode()),
                    quote(key, safe="").replace("_", "%5F")):
        line = redact(f"GET /v1/models?api_key={spelled} HTTP/1.1")
        assert key not in unquote(line) and key[:VISIBLE_PREFIX_LEN] in unquote(line)
    assert redact("a 50% share, 100%") == "a 50% share, 100%"


def test_the_handler_filter_redacts_messages_arguments_and_tracebacks():
    key = generate_raw_key()
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.addFilter(RedactKeys())
    logger = logging.getLogger("tests.redaction")
    logger.addHandler(handler)
    logger.propagate = False
    try:
        logger.warning("Not Found: %s", f"/v1/{key}")
        try:
            raise ValueError(f"bad key {key}")
        except ValueError:
            logger.exception("failed")
    finally:
        logger.removeHandler(handler)
    text = out.getvalue()
    assert key[VISIBLE_PREFIX_LEN:] not in text
    assert f"Not Found: /v1/{key[:VISIBLE_PREFIX_LEN]}…" in text
    assert f"ValueError: bad key {key[:VISIBLE_PREFIX_LEN]}…" in text


def test_the_access_log_redacts_the_request_line():
    key = generate_raw_key()
    out = io.StringIO()
    RedactingAccessLog(out)("http", "complete", {
        "client": "127.0.0.1:1", "method": "GET", "path": f"/v1/models?api_key={key}",
        "status": 401, "size": 10})
    assert key[VISIBLE_PREFIX_LEN:] not in out.getvalue()
    assert f'"GET /v1/models?api_key={key[:VISIBLE_PREFIX_LEN]}…" 401 10' in out.getvalue()
