"""``python -m launcher``: the ``llm-suite`` command without installing its console script."""

import sys

from launcher.cli import main

sys.exit(main())
