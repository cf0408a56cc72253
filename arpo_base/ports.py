"""Listening ports: :func:`check_port` refuses a port another program holds.

It lives in the base room because both the training command (``arpo train --view``) and the viewer it starts check
the port before printing an address, and the training command may not import the server's package.
"""

from __future__ import annotations

import socket

from arpo_base.errors import ArpoError

__all__ = ["check_port"]


def check_port(host: str, port: int) -> None:
    """Refuse a port another program holds before an address is printed that would not answer."""
    family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
    with socket.socket(family) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: only a listener refuses
        try:
            s.bind((host.strip("[]"), port))
        except OSError as e:
            raise ArpoError(
                f"cannot listen on {host}:{port}: {e.strerror}",
                hint="another program holds it (an earlier arpo view?): pick a port with --port",
            ) from None
