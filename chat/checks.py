"""The chat's system checks (``manage.py check``, run before migrations and by the tests)."""

from __future__ import annotations

from django.core.checks import Error, register

from chat.conf import MAX_RESUME_GRACE_S, chat_settings


@register()
def resume_grace_in_range(app_configs=None, **kwargs) -> list[Error]:
    """``CHAT["RESUME_GRACE_S"]`` within 0 and :data:`~chat.conf.MAX_RESUME_GRACE_S`: an
    answer's events must still be in Redis when its page comes back."""
    value = chat_settings()["RESUME_GRACE_S"]
    try:
        ok = 0 <= float(value) <= MAX_RESUME_GRACE_S
    except (TypeError, ValueError):
        ok = False
    if ok:
        return []
    return [Error(f"CHAT_RESUME_GRACE_S is {value!r}; it must be a number of seconds within 0 "
                  f"and {MAX_RESUME_GRACE_S:g} (an answer's events stay in Redis for 600 s "
                  "after its last one).", id="chat.E001")]
