"""The server's commands, ``arpo serve`` and ``arpo view``: the command line finds them through the ``arpo.commands``
entry points in ``pyproject.toml`` (it may not import this package), and calls each module's ``register``."""
