"""Reading a sandboxed child's output: the one pipe loop that the one-shot Python tool
(:class:`arpo_env.tools.python_tool.PythonTool`) and the persistent interpreter (:mod:`arpo_env.tools.interpreter`)
share, with the output limits every backend uses."""

from __future__ import annotations

import os
import selectors
import threading
import time
from collections.abc import Callable, Sequence


def output_limits(max_output_chars: int) -> tuple[int, int]:
    """``(keep, flood)`` for a tool that returns ``max_output_chars`` characters: the bytes kept of each stream (four
    per character, and room for the sandbox's ready mark) and the output in all that stops the child."""
    return 4 * max_output_chars + 1024, max(1 << 20, 16 * max_output_chars)


def read_pipes(
    pipes: Sequence[int],
    *,
    keep: int,
    flood: int,
    deadline: float,
    cancel: threading.Event | None,
    control: int | None = None,
    stop: Callable[[float, bytes], bool] | None = None,
) -> tuple[list[bytearray], bytes, str]:
    """Read the child's output pipes until they all close, or until the call ends another way.

    Each round checks, in this order: the caller's ``cancel`` event (``"cancelled"``), the ``deadline`` (a
    ``time.monotonic()`` value: ``"timeout"``), the output read so far against ``flood`` (``"flood"``), then
    ``stop(now, reply)`` (True: the call is over, ``"ok"``); then it waits up to 0.1 s for data. Each pipe keeps its
    first ``keep`` bytes and the rest is read and dropped (a writer blocked on a full pipe would delay its own kill); a
    pipe's end of file unregisters it.

    Args:
        pipes: The pipes' file descriptors (stdout, stderr).
        keep, flood: Bytes kept per pipe, output in all that ends the call (:func:`output_limits`).
        deadline: When the call times out.
        cancel: The caller's cancel event (set: nobody waits for this call any more), or None.
        control: A further descriptor (the interpreter's control socket) whose bytes are the ``reply``, not output;
            its end of file ends the call (``"ended"``).
        stop: Called each round with the time and the reply so far.

    Returns:
        ``(kept bytes of each pipe, reply, status)``; status ``"ok"`` when every descriptor closed or ``stop`` said so.
    """
    bufs = {fd: bytearray() for fd in pipes}
    reply, total, status = bytearray(), 0, "ok"
    with selectors.DefaultSelector() as sel:
        for fd in (*pipes, *(() if control is None else (control,))):
            sel.register(fd, selectors.EVENT_READ)
        while sel.get_map() and status == "ok":
            now = time.monotonic()
            if cancel is not None and cancel.is_set():
                status = "cancelled"
            elif now > deadline:
                status = "timeout"
            elif total > flood:
                status = "flood"
            if status != "ok" or (stop is not None and stop(now, bytes(reply))):
                break
            for key, _ in sel.select(timeout=min(0.1, max(0.0, deadline - now))):
                chunk = os.read(key.fd, 65536)
                if key.fd == control:
                    if not chunk:
                        status = "ended"
                        break
                    reply += chunk
                    continue
                if not chunk:
                    sel.unregister(key.fd)
                    continue
                total += len(chunk)
                buf = bufs[key.fd]
                buf.extend(chunk[: max(0, keep - len(buf))])
    return [bufs[fd] for fd in pipes], bytes(reply), status


def drain(bufs: dict[int, bytearray], *, keep: int, limit: int) -> None:
    """Read what waits in each pipe now, without blocking, into its buffer (each keeps its first ``keep`` bytes), and
    at most ``limit`` bytes per pipe: a process left behind that keeps writing cannot hold the caller here."""
    for fd, buf in bufs.items():
        os.set_blocking(fd, False)
        read = 0
        try:
            while read <= limit and (chunk := os.read(fd, 65536)):
                read += len(chunk)
                buf.extend(chunk[: max(0, keep - len(buf))])
        except BlockingIOError:
            pass
        finally:
            os.set_blocking(fd, True)
