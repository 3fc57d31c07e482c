"""Session checks shared by every test tier."""

from __future__ import annotations

import pytest


def pytest_sessionstart(session: pytest.Session) -> None:
    """Refuses to run on a compiled block pool older than its source (predictor/sim/kv_blocks.py or
    prefix_cache.py edited or checked out since `make install` built it): unlike the fast predictor, which falls
    back to its .py, the scheduler imports the extension whatever its age, so the tests would test stale code."""
    from predictor.sim import kv_blocks, prefix_cache
    from predictor.sim.predict import _is_stale

    stale = [module.__name__ for module in (kv_blocks, prefix_cache) if _is_stale(module)]
    if stale:
        pytest.exit(f"compiled {', '.join(stale)} older than the .py: rebuild with `make install`", returncode=2)


@pytest.fixture(scope="session", autouse=True)
def _process_logs_in_a_session_folder(tmp_path_factory):
    """Logs of processes a test starts without a ``log_path`` (``astrolabe.procs.ProcessGroup.start`` keeps them,
    for inspection, in a temporary file) go to this session's pytest folder instead of /tmp, so a run leaves none
    behind in /tmp."""
    import functools
    import tempfile
    import types

    from astrolabe import procs

    folder = tmp_path_factory.mktemp("process-logs")
    patch = pytest.MonkeyPatch()
    # private temp folders (`private_tmp`) stay where they were: short paths (Unix sockets), removed with the process
    patch.setattr(procs, "tempfile", types.SimpleNamespace(mkstemp=functools.partial(tempfile.mkstemp, dir=folder),
                                                           mkdtemp=tempfile.mkdtemp))
    yield folder
    patch.undo()
