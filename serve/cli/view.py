"""``arpo view``: look at a run's recorded rollout trees in the browser (the app is :mod:`serve.viewer`), live while
the run trains, or write them into one self-contained HTML file with ``--export``."""

from __future__ import annotations

import argparse
import os
import secrets
import sys
from pathlib import Path

from arpo_base.errors import ArpoError

#: The variable holding the viewer's key (its own: never the serving key ``ARPO_API_KEY``).
VIEW_KEY_ENV = "ARPO_VIEW_KEY"


def cmd_view(args: argparse.Namespace) -> int:
    from arpo_algo.eval.trees import TreeReader, sweep_trials
    from arpo_base.ports import check_port
    from serve.guard import is_loopback, read_key
    from serve.viewer import export_html, run

    if len(args.path) > 2:
        raise ArpoError(
            f"arpo view compares at most two tree folders, got {len(args.path)}",
            hint="arpo view A B: the same prompts of two evaluations, checkpoints or runs side by side",
        )
    if len(args.path) == 1 and (trials := sweep_trials(args.path[0])):
        chosen_trial = _list_trials(args.path[0], trials, args.trial)
        if chosen_trial is None:
            return 0
        args.path = [chosen_trial]
    elif args.trial is not None:
        raise ArpoError(f"--trial picks a trial of a sweep; {args.path[0]} holds no trials with trees")
    # refuses a folder without trees or of a newer format, before anything starts
    readers = [TreeReader(p) for p in args.path]
    reader = readers[0]
    if args.export is not None and len(readers) > 1:
        raise ArpoError("--export writes one folder's trees", hint="export each folder on its own")
    if args.export is not None:
        out, its = export_html(reader.folder, args.export, args.iteration)
        print(f"wrote {out} (iteration{'s' if len(its) > 1 else ''} {', '.join(map(str, its))})")
        return 0
    if args.iteration:
        raise ArpoError("--iteration selects what --export writes", hint="the page has an iteration menu")
    if not 0 < args.port < 65536:
        raise ArpoError(f"--port must be in 1..65535, got {args.port}")
    hosts = [h.strip() for h in (args.allowed_hosts or "").split(",") if h.strip()]
    if not is_loopback(args.host) and not hosts:
        raise ArpoError(
            f"listening on {args.host} needs --allowed-hosts: the host names a browser uses to reach "
            "this viewer (the Host header of any other name is refused)",
            hint="e.g. --allowed-hosts gpu1.example.org; or keep the default 127.0.0.1",
        )
    check_port(args.host, args.port)
    chosen = read_key(args.api_key_file) if args.api_key_file else os.environ.get(VIEW_KEY_ENV, "").strip() or None
    key = chosen or secrets.token_urlsafe(24)
    shown = "127.0.0.1" if args.host in ("0.0.0.0", "::") else args.host
    what = " beside ".join(str(r.folder) for r in readers)
    # A key the user chose is never printed (it may be kept elsewhere, and output lands in logs); a fresh one is this
    # viewer's alone, so the address carries it.
    fragment = "#key=<your key>" if chosen else f"#key={key}"
    print(f"viewing {what} at http://{shown}:{args.port}/{fragment}", flush=True)
    if not is_loopback(args.host):
        print(
            "warning: the key and the trees cross the network in clear text (HTTP); use an SSH tunnel to a "
            "loopback viewer on an untrusted network",
            file=sys.stderr,
            flush=True,
        )
    print("(Ctrl-C stops the viewer)", file=sys.stderr, flush=True)
    run([r.folder for r in readers], host=args.host, port=args.port, key=key, allowed_hosts=hosts)
    return 0


def _list_trials(sweep: Path, trials: list[Path], name: str | None) -> Path | None:
    """Print a sweep's trials with their recorded iterations; the tree folder of the trial ``name`` (or of the only
    trial) to view, or None when there are several and none was named."""
    from arpo_algo.eval.trees import TreeReader

    print(f"{sweep}: {len(trials)} trial{'s' if len(trials) != 1 else ''} with rollout trees")
    for folder in trials:
        its = sorted(TreeReader(folder).refresh())
        span = f"iterations {its[0]}-{its[-1]}" if its else "no iteration yet"
        print(f"  {folder.parent.name}  {span}  {folder}")
    if name is None:
        if len(trials) == 1:
            return trials[0]
        print(f"view one: arpo view {sweep} --trial {trials[0].parent.name}")
        return None
    matches = [f for f in trials if f.parent.name == name] or [f for f in trials if f.parent.name.startswith(name)]
    if len(matches) != 1:
        raise ArpoError(
            f"--trial {name!r} matches {len(matches)} of the sweep's trials",
            hint="give a trial folder name from the list above",
        )
    return matches[0]


def _iterations(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected iteration numbers such as 3 or 1,5, got {text!r}") from None


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``arpo view``."""
    p = sub.add_parser("view", help="browse a run's rollout trees (live while it trains), or --export one HTML file")
    p.add_argument(
        "path",
        type=Path,
        nargs="+",
        metavar="PATH",
        help="a run folder (arpo train --output), an evaluation's (arpo eval --output), a trees/ folder or a "
        "sweep's folder (its trials are listed); two: the same prompts of both side by side",
    )
    p.add_argument(
        "--trial",
        default=None,
        metavar="NAME",
        help="with a sweep folder (arpo tune's output or a Tune experiment): the trial to view (its folder name or "
        "a prefix); without it the sweep's trials are listed",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    p.add_argument("--port", type=int, default=8765, help="port (default 8765)")
    p.add_argument(
        "--allowed-hosts", default=None, help="comma-separated host names browsers use to reach a non-loopback --host"
    )
    p.add_argument(
        "--api-key-file",
        default=None,
        help="a file holding the key the page must send (default: ARPO_VIEW_KEY, else a new random one, "
        "printed in the address)",
    )
    p.add_argument(
        "--export",
        type=Path,
        default=None,
        metavar="OUT.html",
        help="write one self-contained HTML file instead of serving",
    )
    p.add_argument(
        "--iteration",
        type=_iterations,
        default=None,
        metavar="N[,M...]",
        help="with --export: the iterations to include (default: the last recorded)",
    )
    p.set_defaults(func=cmd_view)
