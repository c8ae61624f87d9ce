"""A bulk TCP flow for the bed: the "backup" that shares a link with the KV transfers.

    python -m splitserve.testbed.bulk recv PORT         # prints {"listening": PORT}, then on SIGTERM
                                                        # {"bytes": N, "seconds": S}
    python -m splitserve.testbed.bulk send HOST PORT    # writes 1 MiB buffers until stopped

`BulkFlow` runs the two inside hosts of a NetBed (`NetBed.bulk_flow`) and reads the receiver's
byte count when stopped, so a measurement can report what the backup got beside what KV got.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from typing import Callable

_CHUNK = 1 << 20


class BulkFlow:
    def __init__(self, src_argv: Callable[[list[str]], list[str]], dst_argv: Callable[[list[str]], list[str]],
                 dst_address: str, port: int):
        self._src_argv, self._dst_argv = src_argv, dst_argv
        self.address, self.port = dst_address, port
        self._recv: subprocess.Popen | None = None
        self._send: subprocess.Popen | None = None
        self.bytes = 0
        self.seconds = 0.0

    def start(self) -> "BulkFlow":
        me = [sys.executable, "-m", "splitserve.testbed.bulk"]
        self._recv = subprocess.Popen(self._dst_argv([*me, "recv", str(self.port)]), stdout=subprocess.PIPE,
                                      text=True, start_new_session=True)
        line = self._recv.stdout.readline()
        if "listening" not in line:
            self.stop()
            raise RuntimeError(f"bulk flow receiver on port {self.port} did not start: {line!r}")
        self._send = subprocess.Popen(self._src_argv([*me, "send", self.address, str(self.port)]),
                                      stdout=subprocess.DEVNULL, start_new_session=True)
        return self

    def __enter__(self) -> "BulkFlow":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def rate_bps(self) -> float:
        """What the flow got while it ran (after stop())."""
        return 8 * self.bytes / self.seconds if self.seconds else 0.0

    def stop(self) -> None:
        for proc in (self._send, self._recv):
            if proc is None or proc.poll() is not None:
                continue
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(5)
        if self._recv is not None and self._recv.stdout is not None:
            tail = self._recv.stdout.read().strip().splitlines()
            self._recv.stdout.close()
            if tail:
                result = json.loads(tail[-1])
                self.bytes, self.seconds = result["bytes"], result["seconds"]
        self._send = self._recv = None


def _receive(port: int) -> None:
    listener = socket.create_server(("0.0.0.0", port))
    print(json.dumps({"listening": port}), flush=True)
    total, first = 0, None
    done = False

    def finish(*_):
        nonlocal done
        done = True
    signal.signal(signal.SIGTERM, finish)
    listener.settimeout(0.2)
    conn = None
    while conn is None and not done:
        try:
            conn, _ = listener.accept()
        except socket.timeout:
            continue
    if conn is None:
        print(json.dumps({"bytes": 0, "seconds": 0.0}), flush=True)
        return
    buf = bytearray(_CHUNK)
    conn.settimeout(0.2)
    while not done:
        try:
            n = conn.recv_into(buf)
        except (socket.timeout, InterruptedError):
            continue
        if not n:
            break
        first = first or time.monotonic()
        total += n
    print(json.dumps({"bytes": total, "seconds": time.monotonic() - first if first else 0.0}), flush=True)


def _send(host: str, port: int) -> None:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    conn = socket.create_connection((host, port), timeout=10)
    payload = b"\0" * _CHUNK
    while True:
        conn.sendall(payload)


def main(argv: list[str]) -> None:
    if len(argv) == 2 and argv[0] == "recv":
        _receive(int(argv[1]))
    elif len(argv) == 3 and argv[0] == "send":
        _send(argv[1], int(argv[2]))
    else:
        sys.exit("usage: python -m splitserve.testbed.bulk recv PORT | send HOST PORT")


if __name__ == "__main__":
    main(sys.argv[1:])
