"""Run a command as under Docker's default seccomp profile, as far as sandbox.py is concerned: unshare(2) fails
with EPERM, every other system call is allowed.

    python tests/refuse_unshare.py COMMAND [ARGS...]

A real seccomp filter (inherited by every child process and kept across exec), so the sandbox meets exactly the
refusal it meets in such a container. x86_64 and aarch64 only.
"""
import ctypes
import errno
import os
import platform
import struct
import sys

NR_UNSHARE = {"x86_64": 272, "aarch64": 97}[platform.machine()]
BPF_LD_W_ABS, BPF_JEQ_K, BPF_RET_K = 0x20, 0x15, 0x06
SECCOMP_RET_ALLOW, SECCOMP_RET_ERRNO = 0x7FFF0000, 0x00050000
PR_SET_SECCOMP, SECCOMP_MODE_FILTER, PR_SET_NO_NEW_PRIVS = 22, 2, 38


def instruction(code: int, k: int, jump_true: int = 0, jump_false: int = 0) -> bytes:
    return struct.pack("HBBI", code, jump_true, jump_false, k)  # struct sock_filter


PROGRAM = b"".join([
    instruction(BPF_LD_W_ABS, 0),                        # A = seccomp_data.nr
    instruction(BPF_JEQ_K, NR_UNSHARE, 0, 1),            # unshare? next : skip one
    instruction(BPF_RET_K, SECCOMP_RET_ERRNO | errno.EPERM),
    instruction(BPF_RET_K, SECCOMP_RET_ALLOW),
])


class SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def refuse_unshare() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    code = ctypes.create_string_buffer(PROGRAM, len(PROGRAM))
    program = SockFprog(len(PROGRAM) // 8, ctypes.addressof(code))
    ulong = ctypes.c_ulong
    if libc.prctl(PR_SET_NO_NEW_PRIVS, ulong(1), ulong(0), ulong(0), ulong(0)) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
    if libc.prctl(PR_SET_SECCOMP, ulong(SECCOMP_MODE_FILTER), ctypes.byref(program), ulong(0), ulong(0)) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_SECCOMP)")
    if libc.unshare(0x00020000) != -1 or ctypes.get_errno() != errno.EPERM:  # CLONE_NEWNS: must be refused now
        raise RuntimeError("the seccomp filter did not refuse unshare")


if __name__ == "__main__":
    refuse_unshare()
    os.execvp(sys.argv[1], sys.argv[1:])
