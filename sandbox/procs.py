"""The processes of a jail, seen from the host through /proc: which live in a pid namespace, which run as a uid.

The jail's closing checks use them (sandbox/jail.py: no process of a closed jail, none of the agent's uid, is left
before the verifier starts or the report is decided). Standard library only.
"""
import os
import signal


def pidns_procs(ns):
    """Host pids of the live processes in pid namespace `ns` (a readlink of /proc/PID/ns/pid); zombies are dead
    (they run no code) and left out: the jail's pid 1 stays one until the host's init reaps it."""
    out = []
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                if os.readlink(f"/proc/{p}/ns/pid") == ns:
                    with open(f"/proc/{p}/stat") as f:
                        if f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X"):
                            out.append(int(p))
            except OSError:
                pass
    return out


def uid_procs_in(ns, uid):
    """Host pids of the processes of pid namespace `ns` whose real uid is `uid`."""
    out = []
    for p in pidns_procs(ns):
        try:
            with open(f"/proc/{p}/status") as f:
                if any(ln.startswith("Uid:") and ln.split()[1] == str(uid) for ln in f):
                    out.append(p)
        except OSError:
            pass
    return out


def kill_group(proc):
    """SIGKILL the process group `proc` leads (started with start_new_session) and reap it."""
    if proc is not None and proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the process group we started (start_new_session)
        except ProcessLookupError:
            pass
        proc.wait()
