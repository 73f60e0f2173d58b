"""``python -m cgx_ps.cli``: the ``cgx-ps`` command."""

import sys

from .commands import main

sys.exit(main())
