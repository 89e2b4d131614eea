"""Caches are private to their account: a folder another account planted where a cache would
live is refused and never served, a cache filled by one account is unreadable to another, and
only ``ZARRFEED_CACHE_GROUP`` shares it (real processes: the second account is ``nobody``, a
child that drops root's ids with ``os.setgid``/``os.setuid`` before it acts)."""

from __future__ import annotations

import json
import os
import pwd
import re
import shutil
import stat
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import numpy as np
import pytest

from zarrfeed import cachedirs
from zarrfeed.errors import ConfigError
from zarrfeed.store.disktier import DiskTier, open_tier, tier_folder
from zarrfeed.training.data.arena import ChunkArena
from zarrfeed.training.data.arrays import SharedArrayCache
from zarrfeed.training.data.shm import CacheFolder, list_caches, shm_root

pytestmark = pytest.mark.skipif(
    not hasattr(os, "geteuid") or os.geteuid() != 0,
    reason="acting as a second account (nobody) needs root",
)

NOBODY = pwd.getpwnam("nobody")
ZARRFEED = "from zarrfeed.training.data.arrays import SharedArrayCache"
BUDGET = 1 << 20

# The child imports as root (the interpreter may live under root's 0700 home), then drops to
# nobody's ids, and only then acts; it prints one JSON line.
PRELUDE = """
import json, os, sys
import numpy as np
{imports}
groups = json.loads(sys.argv[3])
os.setgroups(groups)
os.setgid(int(sys.argv[2]))
os.setuid(int(sys.argv[1]))
assert os.geteuid() == int(sys.argv[1]) and os.getegid() == int(sys.argv[2])
"""


def as_nobody(
    body: str, groups: tuple[int, ...] = (), env: dict | None = None, imports: str = ""
) -> object:
    """Run ``body`` as nobody (with ``groups`` as its supplementary groups, after
    ``imports`` as root); what it prints."""
    code = PRELUDE.format(imports=imports) + textwrap.dedent(body)
    args = [str(NOBODY.pw_uid), str(NOBODY.pw_gid), json.dumps(list(groups))]
    done = subprocess.run(
        [sys.executable, "-c", code, *args],
        env={**os.environ, **(env or {})},
        cwd="/",
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture
def base(monkeypatch):
    """A world-writable sticky base, as ``/dev/shm`` is, for the caches and the disk tier."""
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else "/tmp"
    made = Path(tempfile.mkdtemp(prefix="zarrfeed-privacy-", dir=shm))
    os.chmod(made, 0o1777)
    (made / "disk").mkdir()
    os.chmod(made / "disk", 0o1777)
    monkeypatch.setenv("ZARRFEED_CACHE_ROOT", str(made))
    monkeypatch.setenv("ZARRFEED_DISK_CACHE", str(made / "disk"))
    monkeypatch.setenv("ZARRFEED_DISK_CACHE_GB", "1")
    monkeypatch.delenv(cachedirs.GROUP_VAR, raising=False)
    yield made
    shutil.rmtree(made, ignore_errors=True)


def mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def fill_caches() -> dict[str, Path]:
    """One cache of each kind filled by this process: the paths of a file of each."""
    entries = SharedArrayCache("store-of-root", BUDGET, {"store": "/data/private.zarr"})
    entries.get("volume", lambda: np.arange(1000, dtype=np.float32))
    arena = ChunkArena(CacheFolder("chunks", "0123456789abcdef", {"store": "x"}), BUDGET, 4096)
    claimed, _ = arena.claim([(1, 2)])
    arena.view(claimed[0][1], np.dtype(np.float32), (1024,))[:] = 7.0
    arena.publish(claimed)
    tier = open_tier()
    key = DiskTier.key("s3://bucket/private", "ct/windows/a/lung/c/0/0/0")
    tier.put(key, b"decoded secret" * 100)
    found = {
        "npy": entries._path("volume"),
        "meta": entries.folder / "meta.json",
        "arena": arena.folder.path / "arena",
        "tier": Path(tier._path(key)),
    }
    entries.close()
    arena.close()
    return found


# (a) planted folders --------------------------------------------------------------------------
@pytest.mark.parametrize("planted_mode", [0o777, 0o700], ids=["0777", "0700"])
def test_a_cache_root_planted_by_another_account_is_refused_never_served(base, planted_mode):
    cache = SharedArrayCache("store-a", BUDGET)
    root, entry, tier = shm_root(), cache._path("volume"), tier_folder()
    assert root == base / f"zarrfeed-{os.geteuid()}" and entry.parent.parent == root
    assert tier == base / "disk" / f"zarrfeed-{os.geteuid()}"
    as_nobody(f"""
        os.umask(0)
        os.makedirs({str(tier / "ab")!r})
        with open({str(tier / "ab" / ("ab" * 16))!r}, "wb") as f:
            f.write(b"planted chunk")
        os.chmod({str(tier)!r}, {planted_mode})
        os.makedirs({str(entry.parent)!r})
        with open({str(entry.parent / "meta.json")!r}, "w") as f:
            f.write('{{"kind": "arrays", "store": "store-a"}}')
        np.save({str(entry)!r}, np.full(1000, 666, np.float32))  # the planted values
        os.chmod({str(root)!r}, {planted_mode})
        print(json.dumps(0))
    """)
    assert os.lstat(root).st_uid == NOBODY.pw_uid and entry.exists()  # really planted
    loaded = []
    with pytest.raises(ConfigError) as refused:
        cache.get("volume", lambda: loaded.append(1) or np.zeros(1000, np.float32))
    message = str(refused.value)
    assert f"cache folder {root} is owned by uid {NOBODY.pw_uid} (nobody)" in message
    assert f"mode {planted_mode:04o}" in message
    assert f"rm -rf {root}" in message and cachedirs.GROUP_VAR in message
    assert not loaded and not cache._mapped  # nothing read from it, nothing decoded into it
    with pytest.raises(ConfigError, match="owned by uid 65534"):
        list_caches()  # `zarrfeed cache list` says the same
    assert np.load(entry)[0] == 666  # left as it was: refused, not "repaired"
    with pytest.raises(ConfigError, match=re.escape(f"cache folder {tier} is owned by uid 65534")):
        open_tier()  # the disk tier of an object store likewise


def test_a_planted_symlink_to_a_folder_of_root_is_refused_for_both_tiers(base):
    victim = base / "root-private"
    victim.mkdir(mode=0o700)  # a folder of root that would pass every check if followed
    os.chmod(victim, 0o700)
    root, tier = shm_root(), tier_folder()
    as_nobody(f"""
        os.symlink({str(victim)!r}, {str(root)!r})
        os.symlink({str(victim)!r}, {str(tier)!r})
        print(json.dumps(0))
    """)
    assert os.path.islink(root) and os.path.islink(tier)
    with pytest.raises(ConfigError) as refused:
        SharedArrayCache("store-l", BUDGET).get("volume", lambda: np.zeros(10))
    assert f"cache folder {root} is a symbolic link (to {victim}) owned by uid 65534" in str(
        refused.value
    )
    with pytest.raises(ConfigError) as refused:
        open_tier()
    assert f"cache folder {tier} is a symbolic link (to {victim})" in str(refused.value)
    assert list(victim.iterdir()) == []  # nothing of root's was written through the links


def test_a_cache_folder_with_another_mode_or_owner_inside_the_root_is_refused(base):
    cache = SharedArrayCache("store-m", BUDGET)
    cache.get("volume", lambda: np.ones(10))
    cache.close()
    os.chmod(cache.folder, 0o755)  # readable by all: its contents may have leaked or be stale
    expected = re.escape(f"cache folder {cache.folder} is owned by uid 0 (root) with mode 0755")
    with pytest.raises(ConfigError, match=expected):
        SharedArrayCache("store-m", BUDGET).get("volume", lambda: np.zeros(10))
    os.chmod(cache.folder, 0o700)
    os.chown(cache.folder, NOBODY.pw_uid, NOBODY.pw_gid)
    with pytest.raises(ConfigError, match=re.escape("owned by uid 65534 (nobody) with mode 0700")):
        SharedArrayCache("store-m", BUDGET).get("volume", lambda: np.zeros(10))


def test_a_world_writable_base_without_the_sticky_bit_is_refused(base, monkeypatch):
    loose = base / "loose"
    loose.mkdir()
    os.chmod(loose, 0o777)
    monkeypatch.setenv("ZARRFEED_CACHE_ROOT", str(loose))
    expected = f"cache base {re.escape(str(loose))} .* without the sticky bit"
    with pytest.raises(ConfigError, match=expected):
        SharedArrayCache("store-w", BUDGET).get("volume", lambda: np.zeros(10))


# (b) unreadable to another account ------------------------------------------------------------
def test_b_a_cache_filled_by_root_is_unreadable_to_another_account(base):
    files = fill_caches()
    assert all(p.is_file() for p in files.values())
    seen = as_nobody(f"""
        out = {{}}
        for name, path in {json.dumps({k: str(v) for k, v in files.items()})}.items():
            try:
                open(path, "rb").close()
                out[name] = "read"
            except OSError as exc:
                out[name] = type(exc).__name__
        for name, path in (("root", {str(shm_root())!r}), ("tier", {str(tier_folder())!r})):
            try:
                os.listdir(path)
                out[name + " listing"] = "listed"
            except OSError as exc:
                out[name + " listing"] = type(exc).__name__
        print(json.dumps(out))
    """)
    assert seen == {
        "npy": "PermissionError",
        "meta": "PermissionError",
        "arena": "PermissionError",
        "tier": "PermissionError",
        "root listing": "PermissionError",
        "tier listing": "PermissionError",
    }


def test_b_another_account_gets_its_own_root_and_never_roots_caches(base):
    fill_caches()
    seen = as_nobody("""
        cache = SharedArrayCache("store-of-root", 1 << 20, {"store": "/data/private.zarr"})
        got = cache.get("volume", lambda: np.full(1000, -1, np.float32))
        print(json.dumps([str(cache.folder), float(got[5])]))
    """, imports=ZARRFEED)  # fmt: skip
    assert seen == [str(base / "zarrfeed-65534" / files_name("store-of-root")), -1.0]
    assert os.lstat(base / "zarrfeed-65534").st_uid == NOBODY.pw_uid


def files_name(name: str) -> str:
    return SharedArrayCache(name, BUDGET).folder.name


# (c) modes ------------------------------------------------------------------------------------
def test_c_cache_files_are_0600_and_folders_0700_whatever_the_umask(base):
    old = os.umask(0)  # what a careless environment sets: the modes must not come from it
    try:
        fill_caches()
    finally:
        os.umask(old)
    for top in (shm_root(), tier_folder()):
        assert mode(top) == 0o700 and os.lstat(top).st_uid == os.geteuid()
        dirs = files = 0
        for folder, subs, names in os.walk(top):
            for sub in subs:
                assert mode(Path(folder) / sub) == 0o700, Path(folder) / sub
                dirs += 1
            for name in names:
                assert mode(Path(folder) / name) == 0o600, Path(folder) / name
                files += 1
        assert dirs >= 1 and files >= 3  # the walk saw the caches' folders and files


# (d) sharing with a group ---------------------------------------------------------------------
def test_d_with_the_group_setting_a_member_reads_and_others_do_not(base, monkeypatch):
    gid = 100  # "users" where it exists; a bare gid works the same
    monkeypatch.setenv(cachedirs.GROUP_VAR, str(gid))
    old = os.umask(0o077)  # the umask would take the group's bits: the modes must not
    try:
        files = fill_caches()
    finally:
        os.umask(old)
    root = shm_root()
    assert root == base / f"zarrfeed-g{gid}"
    assert mode(root) == 0o2770 and os.lstat(root).st_gid == gid
    assert mode(files["npy"]) == 0o660 and os.lstat(files["npy"]).st_gid == gid
    assert mode(files["tier"].parent) == 0o2770 and mode(files["tier"]) == 0o660
    read = """
        try:
            cache = SharedArrayCache("store-of-root", 1 << 20, {"store": "/data/private.zarr"})
            got = cache.get("volume", lambda: np.full(1000, -1, np.float32))
            print(json.dumps([str(cache.folder), float(got[5])]))
        except Exception as exc:
            print(json.dumps([type(exc).__name__, str(exc)]))
    """
    member = as_nobody(read, groups=(gid,), imports=ZARRFEED)
    assert member == [str(files["npy"].parent), 5.0]  # root's entry, not decoded again
    outsider = as_nobody(read, imports=ZARRFEED)
    assert outsider[0] == "ConfigError" and "is not a member of group" in outsider[1]
    private = as_nobody(f"""
        try:
            open({str(files["npy"])!r}, "rb").close()
            print(json.dumps("read"))
        except OSError as exc:
            print(json.dumps(type(exc).__name__))
    """, env={cachedirs.GROUP_VAR: ""})  # fmt: skip
    assert private == "PermissionError"
