import os
import tempfile

import pytest


@pytest.fixture
def tmpdir_path():
    base = os.environ.get("TALLY_TEST_TMP")
    if base:
        os.makedirs(base, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=base) as d:
        yield d
