"""A supervisor (Ray) restarts a dead engine under its id: the frontend's link admits the new process.

- Restarted after the frontend removed the silent instance: the newcomer is asked for its hello
  (not told to stop, as a drained instance is) and joins as a fresh instance.
- Restarted before that, its heartbeat beating its hello: it is admitted back at once, and its hello
  from a new pid replaces the predecessor's (new role included) instead of being refused; after
  that the id is taken again, so a third process cannot claim it.
"""
from __future__ import annotations

import asyncio
import time

from splitserve.protocol import ResendHello, Shutdown
from test_dispatch_faults import FakeEngine, beat, started_client


async def eventually(predicate, engine: FakeEngine | None = None, timeout_s: float = 20.0) -> bool:
    """Waits (beating as `engine`, if given) until predicate() holds; a loaded box may be slow."""
    deadline = time.monotonic() + timeout_s
    while not predicate() and time.monotonic() < deadline:
        if engine is not None:
            engine.heartbeat()
        await asyncio.sleep(0.1)
    return predicate()


def test_an_engine_restarted_after_its_removal_is_asked_for_its_hello_and_joins():
    async def go():
        client = await started_client(heartbeat_timeout_s=0.5, orphan_grace_s=1.0)
        old = FakeEngine(client.address, "e0")
        try:
            old.hello()
            await client.wait_ready(["e0"], 5)
            old.close()  # killed
            assert await eventually(lambda: client.instances["e0"].removed)  # dead, then silent too long
            new = FakeEngine(client.address, "e0")
            received: list = []

            def asked_for_hello() -> bool:
                received.extend(new.received())
                return any(isinstance(m, ResendHello) for m in received)

            assert await eventually(asked_for_hello, new)  # its stats may leave before its hello does
            assert not any(isinstance(m, Shutdown) for m in received)
            new.hello(pid=5151)
            assert await eventually(lambda: client.instances["e0"].alive, new)
            assert client.instances["e0"].hello.pid == 5151
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
            assert await eventually(lambda: not client.instances["e0"].alive)  # dead, not removed
            new = FakeEngine(client.address, "e0")
            # admitted back as if it were the old process
            assert await eventually(lambda: client.instances["e0"].alive, new)
            assert client.instances["e0"].hello.pid == 4242
            new.hello(pid=5151, role="decode")
            assert await eventually(lambda: client.instances["e0"].hello.pid == 5151, new)
            assert client.router.instances["e0"].role == "decode"
            new.hello(pid=6161)  # a third process: the id is taken by a live engine again
            await beat(new, 1.0)
            assert client.instances["e0"].hello.pid == 5151
        finally:
            await client.shutdown()
            if new is not None:
                new.close()
    asyncio.run(go())


def test_the_same_process_saying_hello_twice_is_registered_once_without_an_error(caplog):
    """An engine's stats go out on one socket and its hello on another, so the stats can arrive
    first: the frontend asks for a hello, and then gets two from the same process. The second
    is that process again, not a rival for the id: no error, one instance."""
    import logging

    async def go():
        client = await started_client(heartbeat_timeout_s=5.0)
        engine = FakeEngine(client.address, "e0")
        try:
            with caplog.at_level(logging.DEBUG, logger="splitserve.coordinator.engine_link"):
                engine.hello(pid=7070)
                await client.wait_ready(["e0"], 5)
                engine.hello(pid=7070)
                await beat(engine, 0.5)
            assert client.instances["e0"].alive and client.instances["e0"].hello.pid == 7070
            assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
            assert "said hello twice" in caplog.text
        finally:
            engine.close()
            await client.shutdown()
    asyncio.run(go())


def test_stats_that_overtake_a_starting_engines_hello_do_not_make_it_look_restarted(caplog):
    """At a normal start the first heartbeat (output socket) can arrive before the hello (input
    socket). The frontend waits a moment for the hello instead of asking for one, which made the
    engine drop its requests and log that the frontend had restarted."""
    import logging

    async def go():
        client = await started_client(heartbeat_timeout_s=5.0)
        engine = FakeEngine(client.address, "e0")
        try:
            with caplog.at_level(logging.INFO, logger="splitserve.coordinator.engine_link"):
                engine.heartbeat()
                # the heartbeat has arrived, unknown, before the hello leaves: the overtaking for sure
                assert await eventually(lambda: "e0" in client.link._last_heard)
                engine.hello(pid=7171)
                await client.wait_ready(["e0"], 5)
                await beat(engine, 1.5)  # past the grace: a late ResendHello would have gone out by now
            assert client.instances["e0"].hello.pid == 7171
            assert not any(isinstance(m, ResendHello) for m in engine.received())
            assert "without a hello" not in caplog.text, caplog.text
        finally:
            engine.close()
            await client.shutdown()
    asyncio.run(go())
