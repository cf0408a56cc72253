"""arpo's environments behind other libraries' environment interfaces (TRL: :mod:`arpo_env.adapters.trl`)."""
