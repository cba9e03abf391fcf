"""The jails' seccomp filter: a classic-BPF program built here (no libseccomp), with its syscall tables.

What each jail refuses and why: sandbox/jail.py's docstring ("seccomp"). bwrap installs the filter on the jail's
pid 1 (--seccomp); seccomp_prefix installs it on the host side of every nsenter chain, so the commands that enter a
jail (which do not descend from bwrap) run under it too. Tests: tests/test_sandbox_security.py.
"""
import os
import struct
import sys

# what each jail refuses, by name -> action (sandbox/jail.py's docstring says why); the verifier's jail refuses
# both lists
_REFUSED = {"name_to_handle_at": "eperm", "open_by_handle_at": "eperm", "clone": "flags", "unshare": "flags",
            "clone3": "enosys", "add_key": "eperm", "request_key": "eperm", "keyctl": "eperm",
            "io_uring_setup": "enosys", "io_uring_enter": "enosys", "io_uring_register": "enosys"}
_VERIFIER_REFUSED = {"ptrace": "eperm", "process_vm_readv": "eperm", "process_vm_writev": "eperm",
                     "pidfd_getfd": "eperm"}
_NAMES = ("name_to_handle_at", "open_by_handle_at", "clone", "unshare", "clone3", "add_key", "request_key", "keyctl",
          "io_uring_setup", "io_uring_enter", "io_uring_register", "ptrace", "process_vm_readv", "process_vm_writev",
          "pidfd_getfd")
# per machine: {audit arch (native, then its 32-bit compat ABI): numbers of _NAMES, in order}; from the kernel's
# syscall tables (x86_64: syscall_64.tbl / syscall_32.tbl; aarch64: asm-generic unistd.h / arm's syscall.tbl)
_NUMBERS = {
    "x86_64": {0xC000003E: (303, 304, 56, 272, 435, 248, 249, 250, 425, 426, 427, 101, 310, 311, 438),  # x86_64
               0x40000003: (341, 342, 120, 310, 435, 286, 287, 288, 425, 426, 427, 26, 347, 348, 438)},  # i386
    "aarch64": {0xC00000B7: (264, 265, 220, 97, 435, 217, 218, 219, 425, 426, 427, 117, 270, 271, 438),  # aarch64
                0x40000028: (370, 371, 120, 337, 435, 309, 310, 311, 425, 426, 427, 26, 376, 377, 438)},  # arm
}
_X32_BIT = 0x40000000  # x86_64: syscall numbers of the x32 ABI carry this bit; all of them are refused
_CLONE_NEWUSER = 0x10000000
_RET_ALLOW, _RET_ERRNO = 0x7FFF0000, 0x00050000
_EPERM, _ENOSYS = 1, 38


def _insn(code, k, jt=0, jf=0):
    return struct.pack("=HBBI", code, jt, jf, k)  # struct sock_filter


def seccomp_filter(machine=None, verifier=False) -> bytes:
    """A jail's seccomp program (struct sock_filter[]) for this machine (what it refuses and why:
    sandbox/jail.py's docstring).

    Per syscall: "eperm" -> EPERM; "flags" (clone, unshare) -> EPERM when the flags ask for CLONE_NEWUSER;
    "enosys" (clone3, whose flags sit behind a pointer a filter cannot read, and io_uring) -> ENOSYS, so libc and
    libraries fall back (to clone, to plain reads and writes). An unknown audit arch (a 32-bit ABI the table does
    not know) -> EPERM for every syscall. verifier: _VERIFIER_REFUSED too (ptrace and its relatives).
    """
    machine = machine or os.uname().machine
    if machine not in _NUMBERS:
        raise RuntimeError(f"sandbox: no seccomp syscall table for machine {machine!r} (known: {sorted(_NUMBERS)})")
    refused = {**_REFUSED, **(_VERIFIER_REFUSED if verifier else {})}
    ld_w, jeq, jge, jset, ret = 0x20, 0x15, 0x35, 0x45, 0x06
    prog = [_insn(ld_w, 4)]  # seccomp_data.arch
    for arch, numbers in _NUMBERS[machine].items():
        rules = sorted((nr, refused[name]) for name, nr in zip(_NAMES, numbers, strict=True) if name in refused)
        n = len(rules)
        extra = 1 if arch == 0xC000003E else 0  # x32 check
        # block: ld nr, [jge x32 -> eperm], n x jeq, allow, eperm, enosys, ld args[0], jset NEWUSER, eperm, allow
        at = {"allow": 1 + extra + n, "eperm": 2 + extra + n, "enosys": 3 + extra + n, "flags": 4 + extra + n}
        block = [_insn(ld_w, 0)]  # seccomp_data.nr
        if extra:
            block.append(_insn(jge, _X32_BIT, at["eperm"] - 2, 0))
        for j, (nr, kind) in enumerate(rules):
            here = 1 + extra + j
            block.append(_insn(jeq, nr, at[kind] - here - 1, 0))
        block += [_insn(ret, _RET_ALLOW), _insn(ret, _RET_ERRNO | _EPERM), _insn(ret, _RET_ERRNO | _ENOSYS),
                  _insn(ld_w, 16),  # low 32 bits of seccomp_data.args[0] (little-endian machines only)
                  _insn(jset, _CLONE_NEWUSER, 0, 1), _insn(ret, _RET_ERRNO | _EPERM), _insn(ret, _RET_ALLOW)]
        prog.append(_insn(jeq, arch, 0, len(block)))
        prog += block
    prog.append(_insn(ret, _RET_ERRNO | _EPERM))  # an audit arch not in the table
    return b"".join(prog)


# Installs the filter (hex in argv[1]) with no_new_privs, then execs argv[2:]: the host-side head of every
# nsenter chain, so the agent's commands (which do not descend from bwrap) run under the same filter.
_SECCOMP_EXEC = """import ctypes, os, sys
prog = bytes.fromhex(sys.argv[1])
buf = ctypes.create_string_buffer(prog, len(prog))
class P(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]
fp = P(len(prog) // 8, ctypes.addressof(buf))
libc = ctypes.CDLL(None, use_errno=True)
u = ctypes.c_ulong
if libc.prctl(38, u(1), u(0), u(0), u(0)) or libc.prctl(22, u(2), ctypes.byref(fp), u(0), u(0)):
    sys.exit("seccomp: prctl failed: " + os.strerror(ctypes.get_errno()))
os.execvp(sys.argv[2], sys.argv[2:])
"""


def seccomp_prefix(verifier=False):
    """argv head that installs the filter, then execs the rest (also inside a jail: the venv's python is there)."""
    return [sys.executable, "-I", "-S", "-c", _SECCOMP_EXEC, seccomp_filter(verifier=verifier).hex()]
