"""The persistent interpreter's control socket, parent side: one JSON object per message, after its 4-byte
big-endian length; descriptors (a fork's open files) ride on the length's bytes. The child's side is
``interpreter_child.py``, which imports nothing of arpo."""

from __future__ import annotations

import json
import socket
import struct


def send_message(sock: socket.socket, obj: dict, fds: list[int] | None = None) -> None:
    data = json.dumps(obj).encode()
    msg = struct.pack(">I", len(data)) + data
    if fds:
        socket.send_fds(sock, [msg[:4]], fds)
        msg = msg[4:]
    sock.sendall(msg)


def recv_message(sock: socket.socket, timeout_s: float) -> dict | None:
    """One message, or None at end of file (the process is gone) or for anything that is not one."""
    sock.settimeout(timeout_s)
    try:
        buf = b""
        while len(buf) < 4 or len(buf) < 4 + struct.unpack(">I", buf[:4])[0]:
            chunk = sock.recv(65536)
            if not chunk:
                return None
            buf += chunk
        reply = json.loads(buf[4:])
        return reply if isinstance(reply, dict) else None
    except (TimeoutError, ConnectionError, OSError, ValueError):  # ValueError: not a reply the child's loop wrote
        return None
    finally:
        sock.settimeout(None)
