"""ASGI entry point served by daphne: HTTP through Django (static files included), websockets
through Channels.

``daphne llm_platform.asgi:application``
"""

import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "llm_platform.settings")

# Django must be set up before anything imports models (Channels' auth middleware does).
django_asgi_app = get_asgi_application()

from channels.auth import AuthMiddlewareStack  # noqa: E402
from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402

from chat.outages import DatabaseOutageGuard  # noqa: E402
from llm_platform.routing import (  # noqa: E402
    KnownRoutesOnly,
    SameOriginValidator,
    websocket_urlpatterns,
)
from llm_platform.static_files import StaticFiles  # noqa: E402

application = ProtocolTypeRouter(
    {
        # Static files are served in every run mode; the handler passes other paths to Django.
        "http": StaticFiles(django_asgi_app),
        # Browsers send their page's origin: only this site's own origin (scheme, host and
        # port) and CSRF_TRUSTED_ORIGINS may open a socket with the user's cookies. A database
        # that cannot serve the socket's session and user gets it an error frame, not a drop.
        # A path no route serves is refused first.
        "websocket": KnownRoutesOnly(SameOriginValidator(DatabaseOutageGuard(
            AuthMiddlewareStack(URLRouter(websocket_urlpatterns)))), websocket_urlpatterns),
    }
)
