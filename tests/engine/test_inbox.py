"""A stream's inbox: items in put order, the waiting consumer woken by a put, a cancelled wait
never woken (and the item it missed still there)."""

from __future__ import annotations

import asyncio

from hybridserve.engine.inbox import Inbox


def test_items_come_out_in_order_and_a_put_wakes_the_waiter() -> None:
    async def main() -> list:
        loop = asyncio.get_running_loop()
        inbox = Inbox(loop)
        got: list = []

        async def consume() -> None:
            while len(got) < 3:
                if not inbox.items:
                    await inbox.wait()
                    continue
                got.append(inbox.items.popleft())

        task = asyncio.ensure_future(consume())
        await asyncio.sleep(0)  # the consumer now waits
        loop.call_soon(inbox.put, "a")
        loop.call_soon(inbox.put, "b")
        await asyncio.sleep(0.01)
        inbox.put("c")
        await asyncio.wait_for(task, 5)
        return got

    assert asyncio.run(main()) == ["a", "b", "c"]


def test_a_cancelled_wait_is_not_woken_and_the_item_stays() -> None:
    async def main() -> tuple[bool, list]:
        inbox = Inbox(asyncio.get_running_loop())
        waiter = inbox.wait()
        waiter.cancel()
        inbox.put(1)  # must not set a result on the cancelled future
        return waiter.cancelled(), list(inbox.items)

    assert asyncio.run(main()) == (True, [1])
