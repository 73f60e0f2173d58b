"""Worker scripts the tests start as processes (python tests/workers/NAME.py); tests import
some of their helpers as ``workers.NAME``."""
