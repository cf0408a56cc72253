"""arpo_algo: ARPO, AEPO and GRPO for tool-using LLM agents as RLlib Algorithms.

Rooms, each importing only from the ones before it (``tests/test_layout.py`` enforces this)::

    core        pure math and decisions: tree rules, entropy, advantages, policy losses (registered by name)
    models      where weights come from: registry, pull, name-or-path resolution, tiny test models
    rollout     trajectory types, the agent loop, the token-layout rule, the tree sampler, metrics, engines
    train       learner, tree forward, optimizer and schedule, SFT
    eval        held-out evaluation on the rollout code path
    algorithms  ARPOConfig / AEPOConfig / GRPOConfig with their RLlib Algorithms
    run         experiment files, the run driver, checkpoints, plots
    cli         one module per ``arpo`` command
"""

import importlib.metadata as _md

try:
    __version__ = _md.version("arpo")
except _md.PackageNotFoundError:  # running from a source tree without an install
    __version__ = "0+unknown"
