"""``python -m arpo_algo.cli``: the same as the ``arpo`` command."""

import sys

from arpo_algo.cli.main import main

sys.exit(main())
