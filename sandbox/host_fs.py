"""How the host touches files a task or a jail controls: nothing followed, everything bounded.

copy_task_tree stages an untrusted task dir (environment/app, tests, solution); write_beneath / read_beneath write
and read inside a dir a jail can write without following a link at any component; write_host_file creates the
host's own logs; remove_tree and chown_tree walk a tree the agent built (any depth, links not followed). The rules:
sandbox/jail.py's docstring ("Task dirs are untrusted", "The host writes its own logs"). Standard library only.
"""
import os
import shutil
import stat
import subprocess


def copy_task_tree(src, dst, max_bytes, max_files, links=True):
    """Copy a task's directory (untrusted) to a new directory dst without following any link.

    Refused (ValueError naming the path and why; dst is removed, nothing is left copied): a source root that is a
    link or not a directory; a link that is absolute or whose target leaves the tree being copied (in-tree relative
    links are kept as links); device files, FIFOs, sockets; more than max_files entries or max_bytes of file data;
    a tree deeper than 64 levels; with links=False, every link (for trees a jail wrote: nothing in them is followed
    or kept). The in-tree check is lexical: the host never follows a copied link, only a jail resolves it. Every
    file and directory is opened with O_NOFOLLOW; modes keep rwx bits only (no setuid/setgid/sticky). dst must not
    exist; it is created with mode 0755, owned by the caller.
    """
    src, dst = os.path.abspath(str(src)), os.path.abspath(str(dst))
    try:
        st = os.lstat(src)
    except FileNotFoundError:
        raise ValueError(f"{src}: does not exist") from None
    if stat.S_ISLNK(st.st_mode):
        raise ValueError(f"{src}: is a symbolic link (a task directory must be a real directory)")
    if not stat.S_ISDIR(st.st_mode):
        raise ValueError(f"{src}: is not a directory")
    make_dir(dst, 0o755)
    count = {"files": 0, "bytes": 0}
    try:
        sfd = os.open(src, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        dfd = os.open(dst, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        try:
            _copy_dir(sfd, dfd, src, "", count, max_bytes, max_files, 0, links)
        finally:
            os.close(sfd)
            os.close(dfd)
    except BaseException:
        shutil.rmtree(dst, ignore_errors=True)
        raise
    return count


def _copy_dir(sfd, dfd, src_root, rel, count, max_bytes, max_files, depth, links):
    if depth > 64:
        raise ValueError(f"{os.path.join(src_root, rel)}: more than 64 directory levels")
    for name in sorted(os.listdir(sfd)):
        path, sub = os.path.join(src_root, rel, name), os.path.join(rel, name)
        count["files"] += 1
        if count["files"] > max_files:
            raise ValueError(f"{src_root}: more than {max_files} files and directories (at {path})")
        st = os.lstat(name, dir_fd=sfd)
        mode = stat.S_IMODE(st.st_mode) & 0o777
        if stat.S_ISLNK(st.st_mode):
            target = os.readlink(name, dir_fd=sfd)
            inside = os.path.normpath(os.path.join(rel, target))
            if not links:
                raise ValueError(f"{path}: is a symbolic link (to {target!r}); links are refused here")
            if os.path.isabs(target) or inside == ".." or inside.startswith("../"):
                raise ValueError(f"{path}: link to {target!r} leaves {src_root} (only relative links inside the "
                                 f"tree are copied)")
            os.symlink(target, name, dir_fd=dfd)
        elif stat.S_ISDIR(st.st_mode):
            os.mkdir(name, 0o700, dir_fd=dfd)
            s2 = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=sfd)
            d2 = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=dfd)
            try:
                _copy_dir(s2, d2, src_root, sub, count, max_bytes, max_files, depth + 1, links)
                os.chmod(d2, mode | 0o700)
            finally:
                os.close(s2)
                os.close(d2)
        elif stat.S_ISREG(st.st_mode):
            r = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=sfd)
            try:
                if not stat.S_ISREG(os.fstat(r).st_mode):  # swapped since the lstat
                    raise ValueError(f"{path}: changed while being copied")
                w = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600, dir_fd=dfd)
                try:
                    while True:
                        chunk = os.read(r, 1 << 20)
                        if not chunk:
                            break
                        count["bytes"] += len(chunk)
                        if count["bytes"] > max_bytes:
                            raise ValueError(f"{src_root}: more than {max_bytes} bytes of files (at {path})")
                        os.write(w, chunk)
                    os.fchmod(w, mode)
                finally:
                    os.close(w)
            finally:
                os.close(r)
        else:
            kind = ("a device file" if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode) else
                    "a FIFO" if stat.S_ISFIFO(st.st_mode) else "a socket" if stat.S_ISSOCK(st.st_mode) else
                    "not a regular file")
            raise ValueError(f"{path}: is {kind} (refused in a task directory)")


def make_dir(path, mode, dir_fd=None):
    """os.mkdir with exactly `mode` (FileExistsError if it exists). mkdir's mode is masked by the process umask:
    under a umask of 027 or 077 (or another thread's brief umask change) /app came out 0750 / 0700 and the jail's
    capability-less root could not enter it ("bwrap: Can't chdir to /app: Permission denied": a trial lost)."""
    os.mkdir(path, mode, dir_fd=dir_fd)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=dir_fd)
    try:
        os.fchmod(fd, mode)
    finally:
        os.close(fd)


def write_host_file(path, text):
    """Write a new host-side log file: O_CREAT | O_EXCL | O_NOFOLLOW, so a planted file or link is never followed."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def _open_dir_beneath(base, parts, create_uid=None):
    """fd of base/parts[0]/... walked one component at a time with O_NOFOLLOW (a link anywhere -> OSError ELOOP /
    ENOTDIR); missing dirs are created (0755, chowned to create_uid) when create_uid is not None."""
    fd = os.open(base, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        for part in parts:
            if part in ("", ".", ".."):
                raise ValueError(f"{base}: bad path component {part!r} in {'/'.join(parts)!r}")
            if create_uid is not None:
                try:
                    make_dir(part, 0o755, dir_fd=fd)
                    os.chown(part, create_uid, create_uid, dir_fd=fd, follow_symlinks=False)
                except FileExistsError:
                    pass
            nfd = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            os.close(fd)
            fd = nfd
    except BaseException:
        os.close(fd)
        raise
    return fd


def write_beneath(base, rel, data: bytes, mode=0o644, uid=None):
    """Write data to base/rel (a dir a jail can write) without following a link at any component; the file is
    replaced if it is a regular file; owned by uid (None: the caller)."""
    parts = [p for p in os.path.normpath(rel).split("/") if p not in ("", ".")]
    if not parts or ".." in parts:
        raise ValueError(f"{base}: bad relative path {rel!r}")
    dfd = _open_dir_beneath(base, parts[:-1], create_uid=os.geteuid() if uid is None else uid)
    try:
        fd = os.open(parts[-1], os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_NONBLOCK, mode,
                     dir_fd=dfd)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise ValueError(f"{os.path.join(base, rel)}: not a regular file")
            if uid is not None:
                os.fchown(fd, uid, uid)
            os.write(fd, data)
        finally:
            os.close(fd)
    finally:
        os.close(dfd)


def read_beneath(base, rel, max_bytes):
    """Read base/rel (a file a jail wrote): no link followed at any component, a regular file, at most max_bytes."""
    parts = [p for p in os.path.normpath(rel).split("/") if p not in ("", ".")]
    if not parts or ".." in parts:
        raise ValueError(f"{base}: bad relative path {rel!r}")
    dfd = _open_dir_beneath(base, parts[:-1])
    try:
        fd = os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dfd)
    finally:
        os.close(dfd)
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError(f"{os.path.join(base, rel)}: not a regular file")
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise ValueError(f"{os.path.join(base, rel)}: larger than {max_bytes} bytes")
    return data


def remove_tree(path):
    """rm -rf a trial's tree (fts: any depth; shutil.rmtree recurses in Python and an agent's 3000-level tree raised
    RecursionError out of run_trial's finally); -> None, or the error text (never raises: used in finally blocks)."""
    p = subprocess.run(["rm", "-rf", "--one-file-system", "--", str(path)], capture_output=True, text=True)
    return None if p.returncode == 0 else f"rm -rf {path} failed: {p.stderr[-500:]}"


def chown_tree(path, uid):
    """lchown a tree, links not followed (chown -R -P -h: fts, any depth or path length; a tree the agent built)."""
    p = subprocess.run(["chown", "-R", "-P", "-h", f"{uid}:{uid}", "--", path], capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"sandbox: chown -R {uid} {path} failed: {p.stderr[-500:]}")
