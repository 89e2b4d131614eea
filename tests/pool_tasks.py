"""Tasks for tests/test_workerpool.py: worker processes import them by name."""

import os
import signal


def square_or_fail(job: int, key: str) -> int:
    """``job`` times the key's number; keys naming a failure fail that way."""
    if key == "exit":
        os._exit(3)
    if key == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if key == "raise":
        raise RuntimeError("a bug in the task")
    return job * int(key) ** 2
