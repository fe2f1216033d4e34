"""Fixtures shared by several test modules."""
import signal

import pytest

# A suite started in the background from a script (`cmd &` without job control) gets SIGINT as ignored, and every
# process it starts inherits that: the Ctrl-C tests could not interrupt their commands. Python's own handler here
# gives the children the default disposition again.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN: signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(scope="session")
def s3(tmp_path_factory):
    "One local S3 server for the session, holding the test data (tests/s3server.py); the folder of its local copies."
    pytest.importorskip("moto.server", reason="the S3 server tests need moto[server] (dev requirements)")
    pytest.importorskip("s3fs", reason="the S3 server tests need s3fs (dev requirements)")
    from s3server import fill, serve
    with serve():
        d = tmp_path_factory.mktemp("s3data")
        fill(d)
        yield d


# The modules that take longest, longest first; the rest follow in their usual order. With `pytest -n 2 --dist
# loadfile --no-loadscope-reorder` (README's test command) a worker takes the next module when it finishes one, so
# starting with the long ones lets both workers end together instead of one waiting on a long module started last.
# Seconds each took on two workers here (pytest --durations=0): resume 285, pipeline 253, demo 208, templates 182,
# scale 134, storage_out 131, export 99, vision 81, training 73; every other module under 60.
LONGEST_FIRST = ["test_resume", "test_pipeline", "test_demo", "test_templates", "test_scale", "test_storage_out",
                 "test_export", "test_vision", "test_training", "test_tokenization_lean", "test_parity",
                 "test_offpath_runs", "test_templates_train", "test_tokenization_templates"]


def pytest_collection_modifyitems(config, items):
    rank = {name: k for k, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.stem, len(rank)))   # stable: order within a module is kept
