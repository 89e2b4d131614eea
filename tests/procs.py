"""Processes seen from /proc, for tests that kill some and check what is left."""

from pathlib import Path


def descendants(pid: int) -> list[tuple[int, str]]:
    """(pid, command line) of every live descendant of ``pid``, from /proc."""
    children: dict[int, list[int]] = {}
    commands: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            commands[int(entry.name)] = command
        except OSError:
            continue
        parent = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(parent, []).append(int(entry.name))
    found, todo = [], list(children.get(pid, []))
    while todo:
        child = todo.pop()
        found.append((child, commands[child]))
        todo += children.get(child, [])
    return found


def running(pid: int) -> bool:
    """Whether ``pid`` is alive: not gone and not a zombie waiting for its parent to reap it."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"
