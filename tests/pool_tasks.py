"""Tasks for tests/test_workerpool.py: worker processes import them by name."""

import os
import signal
import threading


def square_or_fail(job: int, key: str) -> int:
    """``job`` times the key's number; keys naming a failure fail that way."""
    if key == "exit":
        os._exit(3)
    if key == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if key == "raise":
        raise RuntimeError("a bug in the task")
    if key == "answer-then-die":  # answers, then is killed while waiting for its next key
        threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGKILL)).start()
        return 0
    return job * int(key) ** 2


def page_faults_of_an_array(job: int, key: str) -> int:
    """Minor page faults while a fresh ``job``-byte array is filled (and then freed)."""
    import resource

    import numpy as np

    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    block = np.empty(job, np.uint8)
    block.fill(1)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    del block
    return faults
