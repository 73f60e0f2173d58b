"""What many tests share: the job token their shards require, and clients that carry it."""

from __future__ import annotations

import atexit
import shutil
import tempfile

from cgx_ps.security import ChannelSecurity, new_token_file

_dir = tempfile.mkdtemp(prefix="cgx-ps-test-token-")
atexit.register(shutil.rmtree, _dir, True)

TOKEN_FILE = new_token_file(_dir)  # one job token for the test session's shards and clients
SECURITY = ChannelSecurity(token_file=TOKEN_FILE)
METADATA = SECURITY.metadata()  # authorization: Bearer <token>, for raw stub calls
