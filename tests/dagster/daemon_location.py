"""The code location ``tests/dagster/daemon.py`` loads in process, over the folder its
test names in ``VOLLEY_TEST_DAEMON_BASE``."""

import os
from pathlib import Path

from tests.dagster.daemon import BASE_ENV, definitions

defs = definitions(Path(os.environ[BASE_ENV]))
