"""The sockets of `serve --api-server-count N`: the HTTP port all API processes share, and each
API process's ZeroMQ identity at the coordinator's hub (entrypoints/api_hub.py). No web stack
here: `serve` reads its flags before importing one."""
from __future__ import annotations

import socket


def listening_socket(host: str, port: int, first: bool = False) -> socket.socket:
    """A listening TCP socket that other processes of this user may bind to the same port.
    first: the coordinator's; it refuses a port another server already listens on, which
    SO_REUSEPORT alone would let it share (Linux lets only the same user's sockets share one)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    if first and port != 0:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind((host, port))  # OSError "Address already in use" when someone listens there
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(False)
    return sock


def http_socket(host: str, port: int, backlog: int = 2048) -> socket.socket:
    """The listening socket of a server with one API process, bound as uvicorn binds its own
    (SO_REUSEADDR, no SO_REUSEPORT); `serve` binds it so a coordinator restart can keep it open.
    OSError ("Address already in use") when the port is taken."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(backlog)
    except OSError:
        sock.close()
        raise
    return sock


def identity(index: int) -> bytes:
    return f"api-{index}".encode()
