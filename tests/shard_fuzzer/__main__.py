"""``python -m tests.shard_fuzzer``: fuzz a fresh shard and print the report; exit status 1 if a
check failed (see run.main)."""

import sys

from .run import main

sys.exit(main())
