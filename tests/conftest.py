import os
import sys

# Spawned ranks import test modules and helpers (mp, tiny_moe) by name from this directory.
HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)


def pytest_collection_finish(session):
    """Start, beside the first tests, what later tests will need (tests/background.py): the
    jobs of the selected tests marked ``background``, and, where a selected test's module
    starts ranks (tests/mp.py), the forkserver they fork from (its imports take seconds of one
    core, which the first such test would otherwise wait for)."""
    import background
    import mp

    if session.config.option.collectonly:
        return
    background.start(job for item in session.items for m in item.iter_markers("background") for job in m.args)
    starters = {id(mp), id(mp.run_ranks), id(mp.forkserver)}
    modules = {getattr(item, "module", None) for item in session.items} - {None}
    if any(id(v) in starters for m in modules for v in vars(m).values()):
        from multiprocessing import forkserver as server

        mp.forkserver()
        # The server, and so every rank, writes to the stdout and stderr it starts with: pytest's
        # capture (suspended while collection ends), as when a test started it, so that a rank's
        # output (warnings, a traceback) shows with the test that ran it, not on the terminal.
        capman = session.config.pluginmanager.getplugin("capturemanager")
        if capman is not None:
            capman.resume_global_capture()
        try:
            server.ensure_running()
        finally:
            if capman is not None:
                capman.suspend_global_capture()
