"""The persistent interpreter's control socket, parent side: one JSON object per message, after its 4-byte
big-endian length; descriptors (a fork's open files) ride on the length's bytes. The child's side is
``interpreter_child.py``, which imports nothing of arpo.

Invariant: the child's end is hostile input. Model code runs in the process that answers on it and can write there,
so a reply is read only up to :data:`MAX_MESSAGE` bytes and only until a total deadline (a length header that
promises more, or a trickle that never ends, is no reply), and the host never buffers more than one message."""

from __future__ import annotations

import json
import select
import socket
import struct
import time

#: The largest control message the host reads from a child (every genuine reply is a few dozen bytes).
MAX_MESSAGE = 64 << 10


def send_message(sock: socket.socket, obj: dict, fds: list[int] | None = None) -> None:
    data = json.dumps(obj).encode()
    msg = struct.pack(">I", len(data)) + data
    if fds:
        socket.send_fds(sock, [msg[:4]], fds)
        msg = msg[4:]
    sock.sendall(msg)


def message_length(buf: bytes) -> int | None:
    """The whole length (header included) of the message that ``buf`` starts, once its header is in; None before.
    A header above :data:`MAX_MESSAGE` gives ``-1``: that channel misbehaves."""
    if len(buf) < 4:
        return None
    n = struct.unpack(">I", buf[:4])[0]
    return -1 if n > MAX_MESSAGE else 4 + n


def parse_message(buf: bytes) -> dict | None:
    """The one JSON object ``buf`` holds exactly (header, body, nothing more), or None."""
    if message_length(buf) != len(buf):
        return None
    try:
        reply = json.loads(buf[4:])
    except ValueError:
        return None
    return reply if isinstance(reply, dict) else None


def pending(sock: socket.socket) -> bool:
    """Whether bytes wait unread on ``sock`` (between a reply and the next request there must be none: a child that
    wrote more than its one reply misbehaves)."""
    try:
        return bool(select.select([sock], [], [], 0)[0]) and bool(sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT))
    except BlockingIOError:
        return False
    except OSError:
        return True  # an error on the socket: not a channel to talk on


def recv_message(sock: socket.socket, timeout_s: float) -> dict | None:
    """One message, within ``timeout_s`` in all; None at end of file (the process is gone), past the deadline, for a
    header above :data:`MAX_MESSAGE`, or for anything that is not one JSON object. Reads only the message's own bytes,
    so nothing of a later one is consumed."""
    deadline = time.monotonic() + timeout_s
    buf = b""
    try:
        while (want := message_length(buf)) is None or len(buf) < want:
            if want == -1:
                return None
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            sock.settimeout(left)
            chunk = sock.recv((4 if want is None else want) - len(buf))
            if not chunk:
                return None
            buf += chunk
        return parse_message(buf)
    except (TimeoutError, ConnectionError, OSError):
        return None
    finally:
        try:
            sock.settimeout(None)
        except OSError:
            pass
