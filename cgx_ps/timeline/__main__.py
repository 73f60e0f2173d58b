"""``python -m cgx_ps.timeline MERGED.json TRACE.json...``: one file for Perfetto."""

import sys

from .merge import main

sys.exit(main())
