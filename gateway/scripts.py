"""The web tier's Lua scripts, run by their SHA1 (``EVALSHA``) instead of their source.

The queue's scripts carry the queue library (``inference/protocol/lua/fair_queue.lua``, about
13 KB): sent with every ``EVAL``, an admission wrote 18 KB to Redis and Redis hashed it again.
A :class:`LuaScript` sends its 40-character SHA1 and falls back to ``EVAL`` (which loads the
script into Redis's cache again) when Redis answers ``NOSCRIPT``: after a restart, a
``SCRIPT FLUSH``, or a failover to a replica that never saw it. Every script is atomic and its
callers already treat a call that fails as not run, so the fallback changes nothing they see.
"""

from __future__ import annotations

import hashlib
from typing import Any

import redis
import redis.asyncio as aioredis
from redis.exceptions import NoScriptError


class LuaScript:
    """A Lua script and its SHA1; call it with :meth:`run` (sync), :meth:`arun` (asyncio) or
    :meth:`queue` (on a pipeline, with :meth:`finish` on that pipeline's replies).

    Args:
        source: the script's Lua source.
    """

    def __init__(self, source: str):
        self.source = source
        self.sha = hashlib.sha1(source.encode()).hexdigest()

    def run(self, client: redis.Redis, numkeys: int, *args: Any) -> Any:
        """``EVALSHA`` (``EVAL`` when Redis does not know the script).

        Raises:
            redis.RedisError: Redis is unreachable, or the script failed.
        """
        try:
            return client.evalsha(self.sha, numkeys, *args)
        except NoScriptError:
            return client.eval(self.source, numkeys, *args)

    async def arun(self, client: aioredis.Redis, numkeys: int, *args: Any) -> Any:
        """:meth:`run` on an asyncio client.

        Raises:
            redis.RedisError: Redis is unreachable, or the script failed.
        """
        try:
            return await client.evalsha(self.sha, numkeys, *args)
        except NoScriptError:
            return await client.eval(self.source, numkeys, *args)

    def queue(self, pipe: redis.client.Pipeline, numkeys: int, *args: Any) -> tuple:
        """Queue an ``EVALSHA`` on ``pipe`` (run with ``execute(raise_on_error=False)``); return
        the call, for :meth:`finish`."""
        pipe.evalsha(self.sha, numkeys, *args)
        return (numkeys, *args)

    def finish(self, client: redis.Redis, calls: list[tuple], replies: list[Any]) -> list[Any]:
        """The replies of the calls :meth:`queue` put on a pipeline, each call Redis did not
        know the script for run again by :meth:`run`; any other error is raised.

        Raises:
            redis.RedisError: Redis is unreachable, or the script failed.
        """
        out = []
        for call, reply in zip(calls, replies, strict=True):
            if isinstance(reply, NoScriptError):
                reply = self.run(client, *call)
            elif isinstance(reply, Exception):
                raise reply
            out.append(reply)
        return out
