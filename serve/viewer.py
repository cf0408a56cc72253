"""``arpo view``: the rollout-tree viewer, a plain ASGI app (Starlette, served by uvicorn; no Ray) over one tree
folder (:mod:`arpo_algo.eval.trees`), and its single-file export.

Routes: ``/`` (the page), ``/viewer.js`` and ``/viewer.css`` (its script and style, fixed names: nothing else on disk
is reachable), ``/v1/index?since=N`` (the index lines after the first N, re-read from disk on every call, so a running
training shows up live) and ``/v1/group?iteration=I&group=G`` (one group's record, read at its offset). Given two
folders (two evaluations, two checkpoints, two runs) both routes take ``side=0|1``; the page draws the same prompt's
trees of the two side by side. The same guard
as ``arpo serve`` runs in front of every route (:mod:`serve.guard`: Host, Origin, and the key on every route but the
page and its two static files); the page takes the key from its URL fragment (never sent to the server) and sends it
as a bearer header.

Model and tool text is hostile: the page inserts it with ``textContent`` only, and its Content-Security-Policy
allows scripts and styles from this origin only (no inline script, nothing external).
"""

from __future__ import annotations

import base64
import hashlib
import json
import threading
from pathlib import Path
from typing import Any

from arpo_algo.eval.trees import TreeReader
from arpo_base.errors import ArpoError
from serve.guard import Guard, Policy, Security, install

STATIC = Path(__file__).parent / "static"
PAGE_CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self' data:; "
    "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)


class _Source:
    """The reader behind the routes; one lock, since the routes run in a thread pool."""

    def __init__(self, folder: Path) -> None:
        self.reader = TreeReader(folder)
        self.rows: list[dict] = []  # index rows in the order they were read (a re-run iteration appears again)
        self.lock = threading.Lock()

    def index(self, since: int) -> dict:
        with self.lock:
            for it in self.reader.refresh():
                self.rows.append(self.reader.iterations[it])
            return {"format": self.reader.format, "total": len(self.rows), "rows": self.rows[since:]}

    def group(self, iteration: int, index: int) -> dict:
        with self.lock:
            return self.reader.group(iteration, index)


def label(folder: Path) -> str:
    """A tree folder's name on the page: the run folder holding ``trees/``, or an evaluated model's label."""
    return folder.parent.name if folder.name == "trees" else folder.name


def build_app(folder: str | Path | list, key: str, *, port: int, allowed_hosts: list[str] | None = None) -> Any:
    """The viewer's ASGI app over ``folder`` (or two folders to compare, side 0 and side 1), guarded with ``key``
    (required on ``/v1``)."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route

    sources = [_Source(Path(f)) for f in (folder if isinstance(folder, list) else [folder])]
    labels = [label(x.reader.folder) for x in sources]
    if len(labels) == 2 and labels[0] == labels[1]:
        labels = [f"{x.reader.folder.parent.name}/{n}" for x, n in zip(sources, labels)]
    # the page and its two static files are open (they hold no data); every data route needs the key
    policy = Policy(
        Security(allow_unauthenticated=True, allowed_hosts=allowed_hosts or [], port=port),
        open_paths=frozenset({"/", "/viewer.js", "/viewer.css"}),
    )
    policy.key = key  # the viewer always has a key (given or generated): /v1 is never open
    install(policy)

    def static(name: str, ctype: str, csp: str | None = None) -> Any:
        body = (STATIC / name).read_bytes()

        async def route(request: Request) -> Response:
            headers = {"Cache-Control": "no-store"}
            if csp:
                headers["Content-Security-Policy"] = csp
            return Response(body, media_type=ctype, headers=headers)

        return route

    def error(status: int, message: str) -> JSONResponse:
        return JSONResponse({"error": {"message": message}}, status_code=status)

    def side(request: Request) -> _Source | None:
        s = request.query_params.get("side", "0")
        return sources[int(s)] if s in ("0", "1")[: len(sources)] else None

    def index(request: Request) -> JSONResponse:
        try:
            since = int(request.query_params.get("since", "0"))
        except ValueError:
            return error(400, "since must be an integer")
        source = side(request)
        if source is None:
            return error(404, f"side must be one of 0..{len(sources) - 1}")
        return JSONResponse({**source.index(max(since, 0)), "sources": labels})

    def group(request: Request) -> JSONResponse:
        try:
            it, gi = int(request.query_params["iteration"]), int(request.query_params["group"])
        except (KeyError, ValueError):
            return error(400, "iteration and group must be integers")
        source = side(request)
        if source is None:
            return error(404, f"side must be one of 0..{len(sources) - 1}")
        try:
            return JSONResponse(source.group(it, gi))
        except (KeyError, IndexError):
            return error(404, f"iteration {it} has no recorded group {gi}")
        except OSError:  # its chunk went away (or is no longer a file) since the index was read
            return error(404, f"iteration {it}'s recorded chunk is gone")
        except ValueError:
            return error(422, f"the recorded bytes of iteration {it}, group {gi} are not a record (cut short?)")

    app = Starlette(
        routes=[
            Route("/", static("viewer.html", "text/html; charset=utf-8", PAGE_CSP)),
            Route("/viewer.js", static("viewer.js", "text/javascript; charset=utf-8")),
            Route("/viewer.css", static("viewer.css", "text/css; charset=utf-8")),
            Route("/v1/index", index),
            Route("/v1/group", group),
        ]
    )
    return Guard(app)


def _sha(text: str) -> str:
    return "'sha256-" + base64.b64encode(hashlib.sha256(text.encode()).digest()).decode() + "'"


def _embed(data: Any) -> str:
    """JSON that cannot end its <script> block: every '<', '>' and '&' becomes a \\u escape (still the same JSON)."""
    text = json.dumps(data, separators=(",", ":"))
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def export_html(folder: str | Path, out: str | Path, iterations: list[int] | None = None) -> tuple[Path, list[int]]:
    """One self-contained HTML file of ``iterations`` (default: the last recorded one): the page's script and style
    inline (allowed by hash in the file's own CSP) and the records in a JSON data block the script reads."""
    reader = TreeReader(folder)
    reader.refresh()
    if not reader.iterations:
        raise ArpoError(
            f"{reader.folder} holds no complete iteration yet", hint="wait for the first iteration of the run to finish"
        )
    chosen = iterations or [max(reader.iterations)]
    missing = [i for i in chosen if i not in reader.iterations]
    if missing:
        raise ArpoError(
            f"iteration {missing[0]} is not recorded in {reader.folder}",
            hint=f"recorded: {', '.join(map(str, sorted(reader.iterations)))}",
        )
    rows = [reader.iterations[i] for i in sorted(chosen)]
    groups = {}
    for row in rows:
        for gi in range(len(row["groups"])):
            try:
                groups[f"{row['iteration']}:{gi}"] = reader.group(row["iteration"], gi)
            except ValueError:
                continue  # cut short: the page says so for this group
    data = {"format": reader.format, "rows": rows, "groups": groups}
    js, css = (STATIC / "viewer.js").read_text(), (STATIC / "viewer.css").read_text()
    body = (STATIC / "viewer.html").read_text()
    csp = (
        f"default-src 'none'; script-src {_sha(js)}; style-src {_sha(css)}; img-src data:; base-uri 'none'; "
        "form-action 'none'"
    )
    head = (
        f'<meta http-equiv="Content-Security-Policy" content="{csp}">\n<style>{css}</style>\n'
        f'<script type="application/json" id="arpo-data">{_embed(data)}</script>'
    )
    page = body.replace('<link rel="stylesheet" href="viewer.css">', head).replace(
        '<script src="viewer.js"></script>', f"<script>{js}</script>"
    )
    out = Path(out)
    out.write_text(page, encoding="utf-8")
    return out, [r["iteration"] for r in rows]


def run(folder: str | Path | list, *, host: str, port: int, key: str, allowed_hosts: list[str] | None = None) -> None:
    """Serve the viewer (one folder, or two compared) until interrupted (uvicorn in this process)."""
    import uvicorn

    uvicorn.run(
        build_app(folder, key, port=port, allowed_hosts=allowed_hosts), host=host, port=port, log_level="warning"
    )
