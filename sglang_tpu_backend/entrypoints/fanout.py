"""Run several single-prompt engine generators as one request, and stop them all at once.

The engine's ``generate`` validates on its first step (raising ``InvalidRequestError``
before it allocates anything) and aborts its request, freeing KV pages and the state slot,
as soon as its consumer stops iterating. :class:`Fanout` keeps one ``__anext__`` task per
generator; :meth:`Fanout.close` cancels those tasks synchronously, so it works even from
inside a cancelled (disconnected) response task, and the generators unwind in their own tasks.
"""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator, Awaitable, Callable

_BACKGROUND: set[asyncio.Task] = set()  # strong refs to cleanup tasks


class ClientDisconnected(Exception):
    """The HTTP client went away before the response was complete."""


class Fanout:
    """``gens[i]`` yields request i's outputs; ``transform(i, out)`` post-processes each one."""

    def __init__(self, gens: list[AsyncIterator[dict]], transform: Callable[[int, dict], dict] | None = None,
                 on_close: Callable[[], None] | None = None):
        self.gens = gens
        self.transform = transform or (lambda i, out: out)
        self.on_close = on_close
        self.tasks: dict[asyncio.Task, int] = {}
        self.closed = False

    def _next(self, i: int) -> None:
        task = asyncio.ensure_future(self.gens[i].__anext__())
        self.tasks[task] = i

    async def first(self) -> list[dict | None]:
        """Every generator's first output (None for one that yields nothing).

        Raises the first generator's exception (e.g. InvalidRequestError) after closing all.
        """
        for i in range(len(self.gens)):
            self._next(i)
        firsts: list[dict | None] = [None] * len(self.gens)
        pending = dict(self.tasks)
        self.tasks.clear()
        try:
            while pending:
                done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    i = pending.pop(task)
                    try:
                        firsts[i] = self.transform(i, task.result())
                    except StopAsyncIteration:
                        continue
                    self._next(i)
        except BaseException:
            self.tasks.update(pending)
            self.close()
            raise
        return firsts

    async def rest(self) -> AsyncIterator[tuple[int, dict]]:
        """``(i, output)`` pairs after :meth:`first`, in completion order."""
        try:
            while self.tasks:
                done, _ = await asyncio.wait(self.tasks, return_when=asyncio.FIRST_COMPLETED)
                for task in sorted(done, key=lambda t: self.tasks[t]):
                    i = self.tasks.pop(task)
                    try:
                        out = task.result()
                    except StopAsyncIteration:
                        continue
                    self._next(i)
                    yield i, self.transform(i, out)
        finally:
            self.close()

    async def last(self) -> list[dict]:
        """Every generator's final output (non-streaming requests)."""
        lasts = await self.first()
        async for i, out in self.rest():
            lasts[i] = out
        return lasts

    def close(self) -> None:
        """Stop every generator now (synchronous; the engine aborts and frees what they hold)."""
        if self.closed:
            return
        self.closed = True
        if self.on_close is not None:
            self.on_close()
        tasks = list(self.tasks)
        self.tasks.clear()
        for t in tasks:
            t.cancel()
        cleanup = asyncio.ensure_future(self._aclose_all(tasks))
        _BACKGROUND.add(cleanup)
        cleanup.add_done_callback(_BACKGROUND.discard)

    async def _aclose_all(self, tasks: list[asyncio.Task]) -> None:
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.gather(*(g.aclose() for g in self.gens if hasattr(g, "aclose")),
                             return_exceptions=True)


async def wait_for_disconnect(receive: Callable[[], Awaitable[dict]]) -> None:
    """Return when the ASGI ``receive`` channel reports ``http.disconnect`` (body already read)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def run_until_disconnect(receive: Callable[[], Awaitable[dict]], work: Awaitable[Any]) -> Any:
    """Await ``work``; cancel it and raise ClientDisconnected if the client goes away first."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(wait_for_disconnect(receive))
    try:
        done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        raise ClientDisconnected()
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
