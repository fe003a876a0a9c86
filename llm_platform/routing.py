"""Websocket routes (Channels consumers); the chat UI's consumers register here."""

from chat.routing import websocket_urlpatterns as chat_websockets

websocket_urlpatterns: list = [*chat_websockets]
