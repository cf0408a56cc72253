"""serve: the Ray Serve application that hosts trained arpo agents behind an OpenAI-compatible API (``arpo serve``).

Modules: :mod:`serve.schema` (request validation, OpenAI-style errors), :mod:`serve.agents` (what is served: model,
checkpoint or run folder; tools), :mod:`serve.batching` (the batching front shared by a replica's requests),
:mod:`serve.runtime` (one agent: training's agent loop, tools and token layout), :mod:`serve.metrics` (Prometheus
metrics through Ray), :mod:`serve.app` (the deployment, its routes, the chat page, the ``serve run`` builder),
:mod:`serve.guard` (the checks in front of every route: API key, Host, Origin, content type, body size;
docs/security.md), :mod:`serve.admin` and :mod:`serve.live` (live agent changes: the admin key, the roots and limits,
staged in every replica and committed all or nothing), :mod:`serve.agent_set` (a replica's changing set of agents),
:mod:`serve.proxy` (the answer of Serve's proxy for a request whose replica was lost),
:mod:`serve.viewer` (``arpo view``: the rollout-tree viewer, a plain ASGI app behind the same guard, without Ray),
:mod:`serve.cli` (the ``arpo serve`` and ``arpo view`` commands, which ``arpo`` finds through its entry points).
"""
