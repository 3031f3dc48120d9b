"""Where a node's agent keeps its SDK socket and flow table: one private runtime directory.

The agent's default directory is ``/run/flowsched`` when it runs as root, else
``$XDG_RUNTIME_DIR/flowsched``, else ``/tmp/flowsched-<uid>``. Clients (the SDK, the plugin)
look for the socket and the table in the same places (:func:`client_path`). A directory the
agent uses must be its own: :func:`prepare_private_dir` refuses one owned by another user or
writable by group or others, because whoever can write the directory can swap the socket
(and read every job's flows, set their levels). Clients apply the same rule to the directory
of the socket they use (:func:`client_dir_problem`) and accept only an agent running as root,
as themselves, or as ``$FLOWSCHED_AGENT_UID`` (:func:`trusted_agent_uids`). The trust model is
in ``docs/security.md``.
"""

from __future__ import annotations

import os
import socket
import stat
import struct

ROOT_DIR = "/run/flowsched"
#: names one more uid (a number) whose agent clients trust, besides root and their own
AGENT_UID_ENV = "FLOWSCHED_AGENT_UID"
SOCKET_NAME = "agent.sock"
TABLE_NAME = "table"
#: the longest flow table path the NCCL plugin uses (its string knobs hold 255 bytes, and it
#: refuses a longer default path rather than truncate it: ``FS_TABLE_PATH_MAX`` in
#: nccl_plugin/src/param.h; tests/nccl_plugin/test_layout_agreement.py checks they agree)
TABLE_PATH_MAX = 255
#: the longest unix socket path (``sun_path`` holds 108 bytes with the terminating NUL)
SOCKET_PATH_MAX = 107
_PATH_LIMITS = {
    TABLE_NAME: (TABLE_PATH_MAX, "flow table", "the NCCL plugin uses at most"),
    SOCKET_NAME: (SOCKET_PATH_MAX, "SDK socket", "a unix socket path has at most"),
}


class RuntimeDirError(RuntimeError):
    """The directory of the socket or the table is unsafe to use (the message says why)."""


def agent_runtime_dir() -> str:
    """The agent's default directory for this user (see the module docstring)."""
    if os.geteuid() == 0:
        return ROOT_DIR
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime:
        return os.path.join(runtime, "flowsched")
    return f"/tmp/flowsched-{os.geteuid()}"


def agent_path(name: str, env: str) -> str:
    """``$env``, else ``name`` in :func:`agent_runtime_dir` (the agent's defaults).

    Raises:
        RuntimeDirError: the default is longer than the table's or the socket's path may be
            (a long ``$XDG_RUNTIME_DIR``: the plugin would look for the table elsewhere, the
            socket could not be bound); the message names the variable and the limit.
    """
    given = os.environ.get(env)
    if given:
        return given
    path = os.path.join(agent_runtime_dir(), name)
    _check_default_length(name, path, env)
    return path


def _check_default_length(name: str, path: str, env: str) -> None:
    if name not in _PATH_LIMITS:
        return
    limit, what, rule = _PATH_LIMITS[name]
    size = _length_as_used(name, path)
    if size > limit:
        runtime = os.fsencode(os.environ.get("XDG_RUNTIME_DIR", ""))
        raise RuntimeDirError(
            f"XDG_RUNTIME_DIR is {len(runtime)} bytes long: the agent's default {what} path "
            f"{path} would be {size} bytes, and {rule} {limit}; set a shorter "
            f"XDG_RUNTIME_DIR, or {env}"
        )


def _length_as_used(name: str, path: str) -> int:
    """``path``'s length in bytes where it is used: the NCCL plugin builds the default table
    path as ``$XDG_RUNTIME_DIR/flowsched/table`` (src/param.c), a byte longer than ``path`` when
    the variable ends with a slash (os.path.join adds none then)."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if name == TABLE_NAME and runtime and os.geteuid() != 0:
        return max(len(os.fsencode(path)), len(os.fsencode(f"{runtime}/flowsched/{name}")))
    return len(os.fsencode(path))


def client_path(name: str, env: str) -> str:
    """Where a client finds the agent's ``name``: ``$env``; for root ``/run/flowsched``; else
    the user's runtime directory when the file is there, else ``/run/flowsched`` when it is
    there (a root agent serving a ``--group``), else the agent's default for this user."""
    return client_paths(name, env)[0]


def client_paths(name: str, env: str) -> list[str]:
    """The places to try for the agent's ``name``, best first (:func:`client_path` is the
    first): a user whose own file and ``/run/flowsched``'s both exist gets both, so a client
    that finds no agent behind its own (a socket left by a user agent that was killed) tries
    the root agent's next."""
    given = os.environ.get(env)
    if given:
        return [given]
    own = os.path.join(agent_runtime_dir(), name)
    if os.geteuid() == 0:
        return [own]
    shared = os.path.join(ROOT_DIR, name)
    places = [own] if os.path.exists(own) and client_dir_problem(own) is None else []
    if os.path.exists(shared):
        places.append(shared)
    return places or [own]


def trusted_agent_uids() -> frozenset[int]:
    """The uids a client accepts as its agent's: root, this user, and ``$FLOWSCHED_AGENT_UID``
    (an agent running as a service account; ignored unless a number)."""
    uids = {0, os.geteuid()}
    extra = os.environ.get(AGENT_UID_ENV, "").strip()
    if extra.isdigit():
        uids.add(int(extra))
    return frozenset(uids)


def client_dir_problem(path: str) -> str | None:
    """Why a client must not use the agent's file ``path`` (its directory is a symbolic link,
    owned by an untrusted user, or writable by group or others), or None. A directory that
    does not exist is no problem here: there is nothing to connect to."""
    directory = os.path.dirname(os.path.abspath(path))
    try:
        info = os.lstat(directory)
    except OSError:
        return None
    try:
        _check_dir(directory, info, trusted_agent_uids())
    except RuntimeDirError as exc:
        return str(exc)
    return None


def prepare_private_dir(path: str, gid: int | None = None) -> None:
    """Create ``path`` (mode 0700, or 0750 owned by group ``gid``) or check an existing one.

    An existing directory must be a real directory (not a symbolic link) owned by this user or
    by root, and not writable by group or others unless it is root's and sticky (``/tmp``:
    nobody can remove or rename another user's file there). With ``gid``, a directory this
    user owns and created, or whose name starts with ``flowsched``, is given that group and mode
    0750, so that the group's members can reach the socket in it (a shared directory such as
    ``/tmp`` is never changed).

    Raises:
        RuntimeDirError: naming the directory and what is wrong with it.
    """
    path = os.path.abspath(path)
    created = False
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        try:
            os.mkdir(path, 0o700)
            created = True
        except FileExistsError:
            pass  # created meanwhile: checked below like any existing one
        info = os.lstat(path)
    _check_dir(path, info)
    # the group and mode are set only on a directory of our own (never on /tmp or a home)
    dedicated = created or os.path.basename(path).startswith("flowsched")
    if gid is not None and dedicated and info.st_uid == os.geteuid():
        if info.st_gid != gid:
            os.chown(path, -1, gid)
        if stat.S_IMODE(info.st_mode) != 0o750:
            os.chmod(path, 0o750)


def _check_dir(path: str, info: os.stat_result, owners: frozenset[int] | None = None) -> None:
    if stat.S_ISLNK(info.st_mode):
        raise RuntimeDirError(f"{path} is a symbolic link; refusing it as the agent's directory")
    if not stat.S_ISDIR(info.st_mode):
        raise RuntimeDirError(f"{path} is not a directory")
    mode = stat.S_IMODE(info.st_mode)
    if info.st_uid not in (owners or (os.geteuid(), 0)):
        raise RuntimeDirError(
            f"{path} is owned by uid {info.st_uid}, not by this user (uid {os.geteuid()}): "
            "another user could swap the socket or the table in it; remove it or choose "
            "another path"
        )
    sticky_by_root = info.st_uid == 0 and mode & stat.S_ISVTX  # /tmp: names cannot be swapped
    if mode & 0o022 and not sticky_by_root:
        raise RuntimeDirError(
            f"{path} is writable by group or others (mode {mode:04o}): another user could swap "
            f"the socket or the table in it; run: chmod go-w {path}"
        )


#: struct ucred: pid_t (signed), uid_t and gid_t (unsigned: a uid of 2**31 or more is no
#: negative number)
_UCRED = "iII"


def peer_credentials(sock: socket.socket) -> tuple[int, int] | None:
    """(pid, uid) of the process at the other end of a unix socket (``SO_PEERCRED``), or None
    when the kernel does not say."""
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize(_UCRED))
    except OSError:
        return None
    pid, uid, _ = struct.unpack(_UCRED, raw)
    return pid, uid
