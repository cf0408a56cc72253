"""What is served: agent specs (which policy, which tools), where a policy folder is found, and the command-line /
``serve run`` arguments that describe them.

A source is a model folder (``config.json``), a training checkpoint (a folder with ``policy/``), a run folder (its
newest checkpoint under ``checkpoints/``), or a registered model name (``arpo model pull``). ``NAME=SOURCE`` sets the
name clients put in ``model``; otherwise the name is the folder's (``run/checkpoints/iter_000004`` -> ``run``).
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from arpo_algo.models.policy_env import SERVED_KEYS
from arpo_base.errors import ConfigError

#: The largest ``max_tokens`` a request may ask for (``--max-tokens-limit``): a server-side ceiling, so one request
#: cannot hold engine rows and the batcher for as long as the context allows.
MAX_TOKENS_LIMIT = 4096
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,63}$")


@dataclass
class AgentSpec:
    """One served agent (plain data: it travels to the replicas as a dict).

    Attributes:
        name: The ``model`` name clients use.
        model_path: The HF policy folder.
        source: What the user gave (for ``/v1/models`` and logs).
        engine: ``"hf"`` or ``"vllm"`` (:func:`arpo_algo.rollout.engines.build_engine`).
        engine_settings: Extra engine keyword arguments (``max_batch_size``, ``dtype``, ...).
        session: The ``ToolSession`` config: ``tools``, ``max_tool_calls``, ``protocol``, ``system_prompt``, ...
        max_tokens: Default ``max_tokens`` when a request gives none (the whole response, tool results included).
        max_tokens_limit: The largest ``max_tokens`` a request may ask for (HTTP 400 beyond).
        base: For a LoRA adapter agent, the folder of the base model it was trained on ("" for full weights).
        fingerprint: The sha256 fingerprint of the base's weights (adapter agents) or of the agent's own weights:
            what ``/v1/models`` names (never a path). The adapter agents of one replica share one base.
    """

    name: str
    model_path: str
    source: str = ""
    engine: str = "hf"
    engine_settings: dict[str, Any] = field(default_factory=dict)
    session: dict[str, Any] = field(default_factory=dict)
    max_tokens: int = 512
    max_tokens_limit: int = MAX_TOKENS_LIMIT
    base: str = ""
    fingerprint: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def resolve_source(source: str) -> tuple[str, Path]:
    """``[NAME=]SOURCE`` -> (name, HF policy folder); raises :class:`ConfigError` naming the source."""
    name, _, path_text = source.rpartition("=") if "=" in source else ("", "", source)
    path = Path(path_text).expanduser()
    if path.is_dir():
        from arpo_algo.models.checkpoints import policy_source

        found = policy_source(path)  # by what the folder holds; refused here, before anything starts
        folder, default = found.folder, found.name
    else:
        from arpo_algo.models import resolve_model_path

        folder, default = resolve_model_path(path_text), path_text  # raises naming the model
    name = name or default
    if not _NAME.match(name):
        raise ConfigError(
            f"agent name {name!r} is not usable as a model name (letters, digits, . _ : - only)",
            hint="give one explicitly: NAME=PATH",
        )
    return name, Path(folder)


def parse_tools(text: str | None) -> dict[str, Any] | None:
    """``--tools``: ``python,search`` (default settings) or a JSON tool spec (``{"python": {"timeout_s": 5}}``)."""
    if text is None or text == "":
        return None
    text = text.strip()
    if text.startswith("{"):
        try:
            spec = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"--tools: invalid JSON: {e}") from None
        if not isinstance(spec, dict):
            raise ConfigError("--tools: the JSON must be an object {tool: settings}")
        return spec
    return {name.strip(): {} for name in text.split(",") if name.strip()}


def build_specs(
    sources: list[str],
    *,
    tools: str | dict | None = None,
    max_tool_calls: int | None = None,
    engine: str = "hf",
    system_prompt: str | None = None,
    protocol: str | None = None,
    max_tokens: int = 512,
    engine_settings: dict[str, Any] | None = None,
    allow_unisolated_python: bool = False,
    max_tokens_limit: int = MAX_TOKENS_LIMIT,
) -> list[AgentSpec]:
    """Specs for every source (the same tools and limits for each); names must be unique.

    A server-side Python tool must reach the sandbox's minimum isolation (no network, not the server's own user): it
    is built and tested here, before anything starts, and refused below it unless ``allow_unisolated_python`` (the
    CLI's ``--allow-unisolated-python``), which then travels in the tool's settings to every replica."""
    if not sources:
        raise ConfigError("nothing to serve: give at least one model folder, checkpoint or run folder")
    from arpo_algo.rollout.engines import ENGINES

    if engine not in ENGINES:
        raise ConfigError(f"unknown engine {engine!r}; choose one of {', '.join(ENGINES)}")
    check_engine(engine, engine_settings or {})
    if max_tool_calls is not None and max_tool_calls < 0:
        raise ConfigError(f"max_tool_calls must be >= 0, got {max_tool_calls}")
    if max_tokens < 1:
        raise ConfigError(f"max_tokens must be >= 1, got {max_tokens}")
    if max_tokens > max_tokens_limit:
        raise ConfigError(
            f"the default max_tokens ({max_tokens}) exceeds the ceiling max_tokens_limit ({max_tokens_limit})",
            hint="raise --max-tokens-limit or lower --max-tokens",
        )
    session: dict[str, Any] = {}
    tool_spec = parse_tools(tools) if isinstance(tools, str) or tools is None else dict(tools)
    for key, value in (
        ("tools", tool_spec),
        ("max_tool_calls", max_tool_calls),
        ("system_prompt", system_prompt),
        ("protocol", protocol),
    ):
        if value is not None:
            session[key] = value
    tools_now = session.get("tools", {"python": {}})
    if isinstance(tools_now, dict) and "python" in tools_now:
        from arpo_env.tools.isolation_checks import require_python_isolation

        record = require_python_isolation(
            tools_now["python"], allow_unisolated_python=allow_unisolated_python, context="serve"
        )
        if allow_unisolated_python and not record["meets_minimum"]:
            session["tools"] = {**tools_now, "python": {**(tools_now["python"] or {}), "allow_unisolated_python": True}}
    _check_session(session)
    specs, seen = [], set()
    for src in sources:
        name, folder = resolve_source(src)
        if name in seen:
            raise ConfigError(f"two agents are named {name!r}", hint="name them: NAME=PATH")
        seen.add(name)
        own = {**trained_session(folder, session), **session}
        if own != session:
            _check_session(own)
        base, fingerprint = weights_identity(folder)
        if base:
            check_adapter_rank(name, folder, engine)
        specs.append(
            AgentSpec(
                name=name,
                model_path=str(folder),
                source=src,
                engine=engine,
                engine_settings=dict(engine_settings or {}),
                session=own,
                max_tokens=max_tokens,
                max_tokens_limit=max_tokens_limit,
                base=base,
                fingerprint=fingerprint,
            )
        )
    check_one_base(specs)
    return specs


def check_adapter_rank(name: str, folder: Path, engine: str) -> int:
    """An adapter agent's rank, refused (naming the engine's servable ranks, e.g. vLLM's max_lora_rank values) when
    the engine cannot serve it."""
    from arpo_algo.models.lora import adapter_settings
    from arpo_algo.rollout.engines import engine_spec

    rank = adapter_settings(folder)[0].rank
    try:
        engine_spec(engine).lora_rank(rank)
    except ConfigError as e:
        raise ConfigError(
            f"agent {name!r}: {e.message}",
            hint="serve it with --engine hf, or merge it first (arpo export --merge) and serve the merged folder",
        ) from None
    return rank


def weights_identity(folder: Path) -> tuple[str, str]:
    """``(base folder, fingerprint)`` of a policy folder: an adapter's recorded base (checked against its weights
    when the folder was resolved) and that base's fingerprint, or ``("", fingerprint of the folder's own weights)``."""
    from arpo_algo.models.lora import _read_marker, is_adapter_folder, weights_fingerprint

    if is_adapter_folder(folder):
        info = _read_marker(folder)
        return str(info["base"]), str(info["fingerprint"])
    try:
        return "", weights_fingerprint(folder)
    except ConfigError:  # no weight files: loading it in the replica fails with its own error; nothing to name here
        return "", ""


def check_agents(specs: list[AgentSpec]) -> None:
    """One replica's agents: unique names, adapters of one base (both refusals name what clashes)."""
    names = [s.name for s in specs]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ConfigError(f"two agents are named {dup[0]!r}", hint="give each agent its own name: NAME=PATH")
    check_one_base(specs)


def check_one_base(specs: list[AgentSpec]) -> None:
    """Every adapter agent of a replica runs on one copy of one base: adapters of two bases are refused here,
    naming both fingerprints, before anything loads."""
    by_base: dict[str, list[str]] = {}
    for s in specs:
        if s.base:
            by_base.setdefault(s.fingerprint, []).append(s.name)
    if len(by_base) > 1:
        (fa, na), (fb, nb) = list(by_base.items())[:2]
        raise ConfigError(
            f"the LoRA adapters given were trained on different base models: {', '.join(na)} on "
            f"{fa[:12]}..., {', '.join(nb)} on {fb[:12]}... (weights fingerprints); one replica "
            "serves adapters of one base",
            hint="serve each base's adapters in their own deployment, or merge the odd ones "
            "(arpo export --merge) and serve them as full-weight agents",
        )


#: Session settings a trained policy's environment decides unless the command line does (one list with the writer's).
TRAINED_KEYS = SERVED_KEYS

log = logging.getLogger("arpo.serve")


def trained_session(folder: Path, given: dict[str, Any]) -> dict[str, Any]:
    """The system prompt, tool-call limit and protocol the policy in ``folder`` was trained with, for those the
    command line did not give: from the folder's own ``arpo_policy.json`` (every policy folder arpo writes: a
    checkpoint's ``policy/``, ``arpo train``'s final policy, an exported copy); {} for a folder without one (a base
    model, an ``arpo sft`` output), after one warning naming the generic defaults it is served with. A checkpoint's
    recorded environment is never rebuilt here: the served tools come from the command line, never from a folder.

    Invariant: an agent served from a trained policy sees, by default, the prompt and limits of its training, so a
    request without a system message is in the distribution it learned; a folder that cannot say what they were is
    served on generic defaults only with a warning saying so.

    Raises:
        ConfigError: the folder's record is unreadable (another format, damaged); the hint names the flags that set
            the values instead.
    """
    from arpo_algo.models.policy_env import POLICY_ENV_FILE, read_policy_env

    missing = [k for k in TRAINED_KEYS if k not in given]
    if not missing:
        return {}
    record = read_policy_env(folder)  # None when absent; a record it cannot read is a ConfigError
    if record is not None:
        return _trained_defaults(folder, record["served_defaults"], given, missing)
    from arpo_env.session import SESSION_DEFAULTS

    protocol = given.get("protocol", SESSION_DEFAULTS["protocol"])
    generic = {
        "system_prompt": f"the generic prompt of the {protocol!r} protocol",
        "max_tool_calls": f"max_tool_calls {SESSION_DEFAULTS['max_tool_calls']}",
        "protocol": f"protocol {protocol!r}",
    }
    log.warning(
        "%s records no training environment (no %s: not a policy folder arpo train wrote): serving it "
        "with %s. If it was trained with other settings, pass %s",
        folder,
        POLICY_ENV_FILE,
        ", ".join(generic[k] for k in missing),
        ", ".join(f"--{k.replace('_', '-')}" for k in missing),
    )
    return {}


def _trained_defaults(
    folder: Path, trained: dict[str, Any], given: dict[str, Any], missing: list[str]
) -> dict[str, Any]:
    """The trained values of the ``missing`` keys, but never a training prompt under another protocol than the one it
    was written for (it describes that protocol's tool format): that protocol's generic prompt instead, said once."""
    out = {k: trained[k] for k in missing if k in trained}
    if "system_prompt" in out and "protocol" in given and given["protocol"] != trained.get("protocol"):
        del out["system_prompt"]
        log.warning(
            "%s was trained with protocol %r and is served with --protocol %r: its training system prompt "
            "describes the %r format, so it gets the generic prompt of the %r protocol. Pass "
            "--system-prompt to choose one",
            folder,
            trained.get("protocol"),
            given["protocol"],
            trained.get("protocol"),
            given["protocol"],
        )
    return out


def check_engine(engine: str, settings: dict[str, Any]) -> None:
    """Fail on the command line, not in a replica: the engine must be available here (vLLM importable for
    ``engine="vllm"``), and every engine setting must be one the engine takes (``max_batch_size`` is the HF engine's;
    vLLM schedules its own batches)."""
    from arpo_algo.rollout.engines import engine_spec

    spec = engine_spec(engine, where="--engine")
    if spec.check_available is not None:
        spec.check_available()
    # what the replica decides from the agents (the shared module, the adapters and their sizing) is not a setting
    decided = {"model", "lora", "adapters", "max_loras", "max_lora_rank"}
    known = sorted(k for k in spec.keywords() if k not in decided)
    for key in settings:
        if key not in known:
            hint = (
                f"{spec.title} schedules its own batches; drop max_batch_size with engine={engine!r}"
                if key == "max_batch_size"
                else f"settings of the {engine} engine: {', '.join(known)}"
            )
            raise ConfigError(f"{key!r} is not a setting of the {engine} engine", hint=hint)


def _check_session(session: dict[str, Any]) -> None:
    """Build the session once here so a bad tool spec fails on the command line, not in a replica."""
    from arpo_env.session import ToolSession

    ToolSession(session)


def specs_from_args(args: dict[str, Any]) -> list[AgentSpec]:
    """Specs from ``serve run serve.app:build key=value`` arguments (all strings) or a config file's ``args``.

    Keys: ``models`` (comma-separated ``[NAME=]SOURCE``; a list in YAML), ``tools``, ``max_tool_calls``, ``engine``,
    ``system_prompt``, ``protocol``, ``max_tokens``, ``max_tokens_limit``, ``max_batch_size``,
    ``allow_unisolated_python``.
    """
    models = args.get("models")
    if isinstance(models, str):
        models = [m.strip() for m in models.split(",") if m.strip()]
    engine_settings = {}
    if args.get("max_batch_size") is not None:
        engine_settings["max_batch_size"] = int(args["max_batch_size"])
    mtc = args.get("max_tool_calls")
    return build_specs(
        list(models or []),
        tools=args.get("tools"),
        engine=str(args.get("engine", "hf")),
        max_tool_calls=int(mtc) if mtc not in (None, "") else None,
        system_prompt=args.get("system_prompt"),
        protocol=args.get("protocol"),
        max_tokens=int(args.get("max_tokens", 512)),
        engine_settings=engine_settings,
        max_tokens_limit=int(args.get("max_tokens_limit", MAX_TOKENS_LIMIT)),
        allow_unisolated_python=str(args.get("allow_unisolated_python", False)).lower() in ("1", "true", "yes"),
    )
