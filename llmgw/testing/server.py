"""An in-process `llmgw server` for tests: started, loaded, and its URL."""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial
from typing import Any

import trio

from llmgw.server.main import ServerConfig, serve_server


async def start_server(
    nursery: trio.Nursery, config: ServerConfig, engines: Mapping[str, Any], *, load_limit: float = 10
) -> str:
    """Start ``serve_server`` in ``nursery`` and wait until it has loaded its state.

    The server listens before it loads (and answers 503 ``starting`` meanwhile),
    so a test that talks to it at once must wait for the load too.

    :returns: the server's base URL (``https://HOST:PORT``).
    :raises trio.TooSlowError: when loading takes longer than ``load_limit`` seconds.
    """
    loaded = trio.Event()
    host, port = await nursery.start(partial(serve_server, config, dict(engines), loaded=loaded))
    with trio.fail_after(load_limit):
        await loaded.wait()
    return f"https://{host}:{port}"
