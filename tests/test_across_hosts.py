"""1P1D with prefill and decode on different hosts of the bed (network namespaces on shaped
links): the KV crosses the link over tcp, and the answer is the colocated one, token for token.
Off loopback the KV socket refuses any peer that does not know the secret."""
from __future__ import annotations

import asyncio
import socket
import threading
import time

import pytest

from cluster_support import Cluster, prompt_of
from netbed_support import BedCluster, needs_netns
from splitserve.kv_transfer import KVTransferConfig
from splitserve.kv_transfer.messages import Fetch, Hello
from splitserve.kv_transfer.transport import AuthError, NetworkError
from splitserve.kv_transfer.wire import Connection, client_handshake
from splitserve.testbed.netbed import LinkSpec, NetBed
from tiny_models import write_tiny_checkpoint

PD = {"prefill-0": ("prefill", "a"), "decode-0": ("decode", "b")}
PROMPTS = [(150, 0), (40, 1), (97, 2)]  # 150 tokens: three prefill chunks, ten KV blocks


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("hosts") / "m", arch="llama")


@pytest.fixture(scope="module")
def colocated(tiny):
    async def go():
        async with Cluster(tiny, {"c": "colocated"}) as cluster:
            return [(await cluster.generate(prompt_of(n, seed), 24))["tokens"] for n, seed in PROMPTS]
    return asyncio.run(go())


@needs_netns
def test_prefill_and_decode_on_two_hosts_give_the_colocated_greedy_tokens(tiny, colocated):
    async def go(bed):
        async with BedCluster(tiny, bed, PD) as cluster:
            results = await asyncio.gather(*(cluster.generate(prompt_of(n, seed), 24, request_id=f"r{i}")
                                             for i, (n, seed) in enumerate(PROMPTS)))
            assert [r["tokens"] for r in results] == colocated
            for r in results:
                report = r["event"].kv_transfer
                assert report.outcome == "ok" and report.transport == "tcp" and report.num_bytes > 0
            await cluster.wait_idle()

    with NetBed(("a", "b"), LinkSpec.parse("1gbit")) as bed:
        asyncio.run(go(bed))


@needs_netns
def test_overlapped_handover_streams_the_kv_during_the_prefill_and_keeps_the_greedy_tokens(tiny, colocated):
    """kv send mode overlap: the decode host gets each multi-chunk request after its first chunk
    (a streamed descriptor, no first token yet) and still answers exactly as colocated."""
    async def go(bed):
        async with BedCluster(tiny, bed, PD, send_mode="overlap") as cluster:
            early = []
            send = cluster.client.link.send

            def spy(engine_id, message):
                descriptor = getattr(message, "kv_descriptor", None)
                if descriptor is not None and descriptor.streamed:
                    early.append((engine_id, message.request_id, list(message.first_token_ids)))
                return send(engine_id, message)
            cluster.client.link.send = spy
            results = await asyncio.gather(*(cluster.generate(prompt_of(n, seed), 24, request_id=f"r{i}")
                                             for i, (n, seed) in enumerate(PROMPTS)))
            assert [r["tokens"] for r in results] == colocated
            assert all(r["event"].kv_transfer.outcome == "ok" for r in results)
            # the prompts longer than one 64-token chunk went over early, without a first token
            assert sorted(rid.split(".")[0] for _, rid, _ in early) == ["r0", "r2"]
            assert all(engine_id == "decode-0" and first == [] for engine_id, _, first in early)
            await cluster.wait_idle()

    with NetBed(("a", "b"), LinkSpec.parse("100mbit")) as bed:
        asyncio.run(go(bed))


@needs_netns
def test_a_failed_stream_is_resumed_and_keeps_the_greedy_tokens(tiny, colocated):
    """Every transfer fails on the decode side: the streamed one ends with the decode instance
    lacking the first token, so the frontend resumes the request once, handing it over at the end
    this time; that transfer fails too and the decode instance recomputes. The answer is intact."""
    async def go(bed):
        async with BedCluster(tiny, bed, PD, send_mode="overlap", decode_fault_rate=1.0) as cluster:
            result = await cluster.generate(prompt_of(150, 0), 24)
            assert result["tokens"] == colocated[0] and result["error"] is None
            assert result["event"].kv_transfer.outcome == "recomputed"
            await cluster.wait_idle()

    with NetBed(("a", "b")) as bed:
        asyncio.run(go(bed))


@needs_netns
def test_a_decode_host_whose_link_goes_down_mid_stream_is_resumed_on_the_prefill_host(tiny):
    """`ip link set down` on host b while it decodes: the frontend hears nothing from decode-0,
    declares it dead, the prefill instance takes over as colocated, and the stream resumes there
    with the same greedy tokens (the engines really sit behind their links: cutting b cuts it off)."""
    prompt = prompt_of(20, 3)

    async def reference():
        async with Cluster(tiny, {"c": "colocated"}) as cluster:
            return (await cluster.generate(prompt, 120))["tokens"]

    async def go(bed, expected):
        async with BedCluster(tiny, bed, PD) as cluster:
            stream = asyncio.create_task(cluster.generate(prompt, 120))
            while not cluster.client.dispatcher.requests or not any(
                    s.instance_id == "decode-0" and s.token_ids for s in cluster.client.dispatcher.requests.values()):
                await asyncio.sleep(0.005)  # the answer is streaming from decode-0, on host b
            bed.link_down("b")
            result = await asyncio.wait_for(stream, 30)
            assert result["tokens"] == expected and result["error"] is None
            assert result["event"].num_retries == 1  # resumed once
            assert {i: inst.alive for i, inst in cluster.client.instances.items()} == {
                "prefill-0": True, "decode-0": False}
            assert cluster.client.instances["prefill-0"].hello.role == "colocated"

    expected = asyncio.run(reference())
    with NetBed(("a", "b")) as bed:
        asyncio.run(go(bed, expected))


@needs_netns
def test_a_prefill_host_cut_off_mid_prompt_in_overlap_mode_is_retried_on_the_decode_host(tiny, colocated):
    """The decode host already streams the prompt's KV (overlap mode) when host a's link goes
    down: the request had no token yet, so it is retried on host b (colocated now), the broken
    stream is dropped, and the answer is the colocated one."""
    async def go(bed):
        async with BedCluster(tiny, bed, PD, send_mode="overlap") as cluster:
            send = cluster.client.link.send
            prefill = cluster.engines["prefill-0"].core
            step = prefill.step
            # a tiny model finishes the prompt faster than `ip link set down` runs: slow each chunk
            prefill.step = lambda: (time.sleep(0.2), step())[1]

            def cut_at_the_early_handover(engine_id, message):
                descriptor = getattr(message, "kv_descriptor", None)
                if descriptor is not None and descriptor.streamed:
                    bed.link_down("a")  # P is between chunks of this prompt
                return send(engine_id, message)
            cluster.client.link.send = cut_at_the_early_handover
            result = await asyncio.wait_for(cluster.generate(prompt_of(150, 0), 24), 30)
            assert result["tokens"] == colocated[0] and result["error"] is None
            assert result["event"].num_retries == 1
            assert cluster.client.instances["decode-0"].hello.role == "colocated"

    with NetBed(("a", "b")) as bed:
        asyncio.run(go(bed))


def _kv_address(cluster: BedCluster) -> tuple[str, int]:
    source = cluster.engines["prefill-0"].core.connector.sender.source_info
    return source.host, source.port


@needs_netns
def test_a_kv_socket_off_loopback_refuses_a_peer_without_the_secret(tiny):
    with pytest.raises(ValueError, match="--kv-secret-file"):
        KVTransferConfig(transport="tcp", host="10.200.0.2")  # the prefill side will not even start

    async def go(bed):
        async with BedCluster(tiny, bed, PD) as cluster:
            host, port = _kv_address(cluster)
            assert host == bed.hosts["a"].address

            def as_host_b(probe):  # a peer on host b, without the secret
                outcome = []

                def run():
                    bed.hosts["b"].enter()
                    conn = Connection(socket.create_connection((host, port), timeout=3), 3)
                    try:
                        outcome.append(probe(conn))
                    except Exception as e:  # noqa: BLE001 - the test inspects it
                        outcome.append(e)
                    finally:
                        conn.close()
                thread = threading.Thread(target=run)
                thread.start()
                thread.join(10)
                return outcome[0]

            wrong = as_host_b(lambda conn: client_handshake(conn, b"not-the-secret", 3))
            assert isinstance(wrong, AuthError) and "authentication failed" in str(wrong)
            empty = as_host_b(lambda conn: (conn.recv(), conn.send(Hello(client_nonce=b"x" * 16, mac=b"")),
                                            conn.recv())[-1])
            assert not empty.ok and "kv secret" in empty.error
            skipped = as_host_b(lambda conn: (conn.recv(), conn.send(Fetch("r0", 0, b"")), conn.recv())[-1])
            assert isinstance(skipped, NetworkError) and "closed" in str(skipped), skipped  # no KV, no reply
            # the refusals cost the real peer nothing
            result = await cluster.generate(prompt_of(40, 1), 8)
            assert result["event"].kv_transfer.outcome == "ok"

    with NetBed(("a", "b")) as bed:
        asyncio.run(go(bed))
