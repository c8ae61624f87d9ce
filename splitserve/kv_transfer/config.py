"""Settings for moving KV blocks between a prefill and a decode instance."""
from __future__ import annotations

import ipaddress
from dataclasses import dataclass

TRANSPORTS = ("fake", "shm", "tcp")
SEND_MODES = ("end", "overlap")


@dataclass(slots=True)
class KVTransferConfig:
    transport: str = "shm"
    lease_s: float = 30.0  # prefill keeps a finished prompt's blocks this long, waiting for the pull
    fault_rate: float = 0.0  # probability a transfer fails on purpose (--kv-fault-rate)
    delay_ms: float = 0.0  # latency added to every transfer (--kv-delay-ms)
    host: str = "127.0.0.1"  # the prefill side's control/data socket; loopback unless told otherwise
    port: int = 0  # 0: pick a free port
    secret: bytes | None = None  # when set, peers must prove they know it (HMAC challenge)
    # Per-peer timeouts, well below the lease: a hung (not dead) prefill instance must fail its
    # own transfers quickly instead of holding pullers that other transfers wait for.
    connect_timeout_s: float = 3.0
    handshake_timeout_s: float = 3.0  # the whole handshake, both sides (slow-drip peers)
    io_timeout_s: float = 10.0  # longest silence inside a transfer
    max_concurrent_transfers: int = 4  # decode-side puller threads, all sources together
    max_transfers_per_source: int = 2  # of those, at most this many talk to one prefill instance
    max_peers: int = 64  # prefill side: connections served at once; more are closed on accept
    seed: int = 0  # for fault injection, so a trial can be replayed
    # end: the KV moves once the prompt is prefilled; overlap: the decode instance gets the request
    # after the first chunk and the blocks stream over tcp as the chunks finish (prefill side's say)
    send_mode: str = "end"

    def __post_init__(self) -> None:
        if self.transport not in TRANSPORTS:
            raise ValueError(f"kv transport must be one of {TRANSPORTS}, got {self.transport!r}")
        if not self.lease_s > 0:
            raise ValueError(f"kv lease_s must be positive seconds, got {self.lease_s}")
        if not 0.0 <= self.fault_rate <= 1.0:
            raise ValueError(f"kv fault_rate is a probability in [0, 1], got {self.fault_rate} "
                             "(--kv-fault-rate 0.2 fails one transfer in five)")
        if self.delay_ms < 0:
            raise ValueError(f"kv delay_ms must be >= 0, got {self.delay_ms}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"kv port must be in 0..65535, got {self.port}")
        if isinstance(self.secret, str):
            self.secret = self.secret.encode()
        if self.secret is not None and len(self.secret) < 8:
            raise ValueError("kv secret is too short to be worth anything; use at least 8 bytes "
                             "(e.g. `openssl rand -hex 16`)")
        if self.send_mode not in SEND_MODES:
            raise ValueError(f"kv send mode must be one of {SEND_MODES}, got {self.send_mode!r}")
        if self.send_mode == "overlap" and self.transport != "tcp":
            raise ValueError("kv send mode 'overlap' streams blocks over tcp while the prompt is prefilled; "
                             "use --kv-transport tcp (shm copies the whole prompt in milliseconds anyway)")
        if self.secret is None and not is_loopback(self.host):
            raise ValueError(f"kv host {self.host!r} is reachable from other machines: without a "
                             "secret anyone there could read or release KV blocks; set a kv "
                             "secret (--kv-secret-file) or bind to 127.0.0.1")
        for name in ("connect_timeout_s", "handshake_timeout_s", "io_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"kv {name} must be positive, got {getattr(self, name)}")
        for name in ("max_concurrent_transfers", "max_transfers_per_source", "max_peers"):
            if getattr(self, name) <= 0:
                raise ValueError(f"kv {name} must be positive, got {getattr(self, name)}")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: assume the network can reach it
