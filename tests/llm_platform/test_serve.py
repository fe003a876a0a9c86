"""The web process's daphne (``llm_platform/serve.py``): its websocket size limits and the
status lines it writes."""

from __future__ import annotations

from chat.frames import MAX_FRAME_CHARS
from llm_platform.serve import DrainingServer, add_reason_phrases


def test_every_frame_the_chat_reads_to_the_end_fits_under_the_servers_limits():
    # A frame of MAX_FRAME_CHARS characters of 4 UTF-8 bytes each must reach the consumer (it
    # answers a longer one with an error frame); daphne's own 1 MiB cut such a connection.
    server = DrainingServer(application=None, endpoints=["tcp:port=0"])
    assert server.websocket_max_message_size >= 4 * MAX_FRAME_CHARS
    assert server.websocket_max_frame_size >= 4 * MAX_FRAME_CHARS
    # An operator's larger limit is kept.
    roomy = DrainingServer(application=None, endpoints=["tcp:port=0"],
                           websocket_max_message_size=64 * 2**20)
    assert roomy.websocket_max_message_size == 64 * 2**20


def test_status_lines_have_their_standard_reason_phrases():
    from twisted.web import http

    add_reason_phrases()
    assert http.RESPONSES[429] == b"Too Many Requests"
    assert http.RESPONSES[431] == b"Request Header Fields Too Large"
    assert http.RESPONSES[404] == b"Not Found"  # twisted's own, unchanged
