"""The one pipe loop of the sandboxed child (``arpo_env/tools/pipes.py``), which the one-shot Python tool and the
persistent interpreter share: output kept up to its cap, the flood and the deadline stop it, end of file ends it."""

from __future__ import annotations

import os
import threading
import time

from arpo_env.tools.pipes import output_limits, read_pipes


def _pipes(n: int = 2) -> list[tuple[int, int]]:
    return [os.pipe() for _ in range(n)]


def _close(*fds: int) -> None:
    for fd in fds:
        os.close(fd)


def test_both_pipes_closed_end_the_call_with_what_each_kept():
    (out_r, out_w), (err_r, err_w) = _pipes()
    os.write(out_w, b"x" * 100)
    os.write(err_w, b"oops")
    _close(out_w, err_w)
    (out, err), reply, status = read_pipes(
        (out_r, err_r), keep=10, flood=1000, deadline=time.monotonic() + 5, cancel=None
    )
    assert (bytes(out), bytes(err), reply, status) == (b"x" * 10, b"oops", b"", "ok")
    _close(out_r, err_r)


def test_the_flood_the_deadline_and_the_cancel_event_end_it():
    (out_r, out_w), (err_r, err_w) = _pipes()
    os.write(out_w, b"y" * 5000)
    (out, _), _, status = read_pipes((out_r, err_r), keep=8, flood=4096, deadline=time.monotonic() + 5, cancel=None)
    assert status == "flood" and bytes(out) == b"y" * 8
    start = time.monotonic()
    _, _, status = read_pipes((out_r, err_r), keep=8, flood=1 << 20, deadline=start + 0.3, cancel=None)
    assert status == "timeout" and 0.3 <= time.monotonic() - start < 2
    event = threading.Event()
    threading.Timer(0.2, event.set).start()
    _, _, status = read_pipes((out_r, err_r), keep=8, flood=1 << 20, deadline=time.monotonic() + 5, cancel=event)
    assert status == "cancelled"
    _close(out_r, out_w, err_r, err_w)


def test_a_control_descriptor_gives_the_reply_and_its_end_ends_the_call():
    (out_r, out_w), (err_r, err_w), (ctl_r, ctl_w) = _pipes(3)
    os.write(out_w, b"printed")
    os.write(ctl_w, b"done")
    (out, _), reply, status = read_pipes(
        (out_r, err_r),
        keep=100,
        flood=1000,
        deadline=time.monotonic() + 5,
        cancel=None,
        control=ctl_r,
        stop=lambda _now, reply: reply == b"done",
    )
    assert (bytes(out), reply, status) == (b"printed", b"done", "ok")
    os.close(ctl_w)
    _, reply, status = read_pipes(
        (out_r, err_r), keep=100, flood=1000, deadline=time.monotonic() + 5, cancel=None, control=ctl_r
    )
    assert (reply, status) == (b"", "ended")
    _close(out_r, out_w, err_r, err_w, ctl_r)


def test_the_limits_follow_the_tools_output_cap():
    assert output_limits(10_000) == (41_024, 1 << 20)
    assert output_limits(100_000) == (401_024, 1_600_000)


def test_drain_reads_what_waits_but_at_most_its_limit():
    """After a reply, the pipes are drained without blocking; a writer left behind that keeps them full cannot keep
    the caller reading: at most ``limit`` bytes (plus one read) per pipe."""
    import fcntl

    from arpo_env.tools.pipes import drain

    r, w = os.pipe()
    try:
        size = fcntl.fcntl(w, fcntl.F_SETPIPE_SZ, 1 << 20)
        os.set_blocking(w, False)
        written = 0
        try:
            while written < size:
                written += os.write(w, b"x" * 65536)
        except BlockingIOError:
            pass
        buf = bytearray()
        drain({r: buf}, keep=100, limit=128 << 10)
        assert len(buf) == 100 and os.get_blocking(r)
        os.set_blocking(r, False)
        left = 0
        try:
            while chunk := os.read(r, 1 << 20):
                left += len(chunk)
        except BlockingIOError:
            pass
        assert 0 < left and written - left <= (128 << 10) + 65536, (written, left)
    finally:
        os.close(r)
        os.close(w)
