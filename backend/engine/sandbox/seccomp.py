"""A seccomp filter for the sandbox: deny the system calls a box has no use for.

Boxed code may not create namespaces (no user namespace from which to mount its own tmpfs),
mount anything, use the kernel keyrings (which outlive a run and would carry data from one
run to the next under the same uid), load BPF programs, watch performance counters, use
`userfaultfd` or `io_uring`, trace other processes or take their file descriptors (`pidfd_getfd`; the wrapper that counts
strays included), or open vsock sockets (to the hypervisor, outside any network namespace). Everything
else is allowed. The program is classic BPF, built here so that no
extra library is needed; bubblewrap installs it (`--seccomp FD`) just before the command runs.
"""

from __future__ import annotations

import platform
import struct

ALLOW = 0x7FFF0000
EPERM, ENOSYS = 1, 38
ERRNO = 0x00050000
LD_W_ABS, JEQ, JGE, JSET, RET = 0x20, 0x15, 0x35, 0x45, 0x06
NR, ARCH, ARG0 = 0, 4, 16  # offsets in struct seccomp_data
X32_BIT = 0x40000000
NEW_NAMESPACES = 0x7E020000  # CLONE_NEWNS | NEWCGROUP | NEWUTS | NEWIPC | NEWUSER | NEWPID | NEWNET
AF_VSOCK = 40  # sockets to the hypervisor and other VMs: no network namespace holds them in

# Per architecture: the audit arch value, the syscalls denied with EPERM, clone, clone3, socket.
ARCHES: dict[str, tuple[int, dict[str, int], int, int, int]] = {
    "x86_64": (
        0xC000003E,
        {"add_key": 248, "request_key": 249, "keyctl": 250, "unshare": 272, "setns": 308, "mount": 165,
         "umount2": 166, "pivot_root": 155, "bpf": 321, "perf_event_open": 298, "userfaultfd": 323,
         "kexec_load": 246, "open_by_handle_at": 304, "open_tree": 428, "move_mount": 429, "fsopen": 430,
         "fsconfig": 431, "fsmount": 432, "fspick": 433, "mount_setattr": 442, "io_uring_setup": 425,
         "io_uring_enter": 426, "io_uring_register": 427, "ptrace": 101, "process_vm_readv": 310,
         "process_vm_writev": 311, "pidfd_getfd": 438},
        56,
        435,
        41,
    ),
    "aarch64": (
        0xC00000B7,
        {"add_key": 217, "request_key": 218, "keyctl": 219, "unshare": 97, "setns": 268, "mount": 40,
         "umount2": 39, "pivot_root": 41, "bpf": 280, "perf_event_open": 241, "userfaultfd": 282,
         "kexec_load": 104, "open_by_handle_at": 265, "open_tree": 428, "move_mount": 429, "fsopen": 430,
         "fsconfig": 431, "fsmount": 432, "fspick": 433, "mount_setattr": 442, "io_uring_setup": 425,
         "io_uring_enter": 426, "io_uring_register": 427, "ptrace": 117, "process_vm_readv": 270,
         "process_vm_writev": 271, "pidfd_getfd": 438},
        220,
        435,
        198,
    ),
}  # fmt: skip


def _insn(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
    return struct.pack("=HBBI", code, jt, jf, k)


def program(machine: str | None = None) -> bytes | None:
    """Return the filter for this machine's architecture, or None if it is not one we know."""
    arch = ARCHES.get(machine or platform.machine())
    if arch is None:
        return None
    audit, denied, clone, clone3, socket = arch
    numbers = sorted(denied.values())
    # Layout: arch check, x32 check, one JEQ per denied call, clone, clone3, socket, ALLOW, then
    # the returns: [clone flags check] [socket family check] [EPERM] [ENOSYS]. Jumps are counted
    # from the next instruction.
    body: list[tuple[int, int, str, str]] = []  # (code, k, jt-label, jf-label)
    body.append((LD_W_ABS, ARCH, "", ""))
    body.append((JEQ, audit, "", "enosys"))
    body.append((LD_W_ABS, NR, "", ""))
    body.append((JGE, X32_BIT, "enosys", ""))
    for nr in numbers:
        body.append((JEQ, nr, "eperm", ""))
    body.append((JEQ, clone3, "enosys", ""))  # glibc falls back to clone, whose flags we can read
    body.append((JEQ, clone, "clone", ""))
    body.append((JEQ, socket, "socket", ""))
    body.append((RET, ALLOW, "", ""))
    labels = {"clone": len(body)}
    body.append((LD_W_ABS, ARG0, "", ""))
    body.append((JSET, NEW_NAMESPACES, "eperm", ""))
    body.append((RET, ALLOW, "", ""))
    labels["socket"] = len(body)
    body.append((LD_W_ABS, ARG0, "", ""))
    body.append((JEQ, AF_VSOCK, "eperm", ""))
    body.append((RET, ALLOW, "", ""))
    labels["eperm"] = len(body)
    body.append((RET, ERRNO | EPERM, "", ""))
    labels["enosys"] = len(body)
    body.append((RET, ERRNO | ENOSYS, "", ""))
    out = b""
    for i, (code, k, jt, jf) in enumerate(body):
        t = labels[jt] - i - 1 if jt else 0
        f = labels[jf] - i - 1 if jf else 0
        assert 0 <= t < 256 and 0 <= f < 256
        out += _insn(code, k, t, f)
    return out
