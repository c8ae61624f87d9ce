"""A supervisor (Ray) restarts a dead engine under its id: the frontend's link admits the new process.

- Restarted after the frontend removed the silent instance: the newcomer is asked for its hello
  (not told to stop, as a drained instance is) and joins as a fresh instance.
- Restarted before that, its heartbeat beating its hello: it is admitted back at once, and its hello
  from a new pid replaces the predecessor's (new role included) instead of being refused; after
  that the id is taken again, so a third process cannot claim it.
"""
from __future__ import annotations

import asyncio

from splitserve.protocol import ResendHello, Shutdown
from test_dispatch_faults import FakeEngine, beat, started_client


def test_an_engine_restarted_after_its_removal_is_asked_for_its_hello_and_joins():
    async def go():
        client = await started_client(heartbeat_timeout_s=0.5, orphan_grace_s=1.0)
        old = FakeEngine(client.address, "e0")
        try:
            old.hello()
            await client.wait_ready(["e0"], 5)
            old.close()  # killed
            await asyncio.sleep(2.0)  # declared dead, then removed for its silence
            assert client.instances["e0"].removed
            new = FakeEngine(client.address, "e0")
            await beat(new, 0.3)  # its stats may leave before its hello does
            received = new.received()
            assert any(isinstance(m, ResendHello) for m in received)
            assert not any(isinstance(m, Shutdown) for m in received)
            new.hello(pid=5151)
            await beat(new, 0.3)
            assert client.instances["e0"].alive and client.instances["e0"].hello.pid == 5151
            assert client.router.instances["e0"].alive
            new.close()
        finally:
            await client.shutdown()
    asyncio.run(go())


def test_a_restart_heard_before_its_hello_takes_over_the_id_once():
    async def go():
        client = await started_client(heartbeat_timeout_s=0.5, orphan_grace_s=30.0)
        old = FakeEngine(client.address, "e0")
        new = None
        try:
            old.hello()
            await client.wait_ready(["e0"], 5)
            old.close()
            await asyncio.sleep(0.9)  # declared dead, not removed
            assert not client.instances["e0"].alive
            new = FakeEngine(client.address, "e0")
            await beat(new, 0.3)  # admitted back as if it were the old process
            assert client.instances["e0"].alive and client.instances["e0"].hello.pid == 4242
            new.hello(pid=5151, role="decode")
            await beat(new, 0.3)
            assert client.instances["e0"].hello.pid == 5151
            assert client.router.instances["e0"].role == "decode"
            new.hello(pid=6161)  # a third process: the id is taken by a live engine again
            await beat(new, 0.3)
            assert client.instances["e0"].hello.pid == 5151
        finally:
            await client.shutdown()
            if new is not None:
                new.close()
    asyncio.run(go())
