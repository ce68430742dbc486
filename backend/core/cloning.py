"""Cloning from a URL: which hosts a study's repository may come from, and a clone that gives up early.

A repository URL given over the API names a host that is resolved here; it is refused when any of
its addresses lies inside this server's network (loopback, link-local, private, unspecified,
multicast, reserved) unless the operator lists the host, or the address, in `GROVE_REPO_HOSTS`
(names, addresses, CIDR networks). When that list is set, no other host is accepted at all. The
clone task checks again just before it clones, and makes git connect to the very addresses it
checked (https: curl's resolve list; git://: the address in the URL), so a name that changes its
answer in between does not reach inside.

A clone is killed when the host sent nothing within `GROVE_CLONE_FIRST_BYTE_TIMEOUT` (nothing on
git's progress output, no object in the new repository) and after `GROVE_CLONE_TIMEOUT` in any
case. `failure` says what went wrong in plain words, never with git's or the network's own text,
which would tell a viewer how the server's network answers; the caller logs that text.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import re
import shutil
import signal
import socket
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from backend.core import gitops, gitrun
from backend.core.config import Settings
from backend.core.errors import FieldError
from backend.core.gitops import GitError

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
SCHEMES = {"https": 443, "ssh": 22, "git": 9418}
# user[:password]@ (one '@' at most: others must be percent-encoded), a host name or a bracketed
# IPv6 address, an optional port. Anything else is refused rather than guessed at: a URL that
# two parsers read differently is how a check is walked around.
_NETLOC = re.compile(
    r"(?:(?P<user>[A-Za-z0-9._~%!$&'()*+,;=][A-Za-z0-9._~%!$&'()*+,;=-]*(?::[^@/\\\s\[\]?#]*)?)@)?"
    r"(?P<host>\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_][A-Za-z0-9._-]*)(?::(?P<port>[0-9]{1,5}))?"
)
_SCP = re.compile(
    r"(?P<user>[A-Za-z0-9._~%+][A-Za-z0-9._~%+-]*)@(?P<host>\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_][A-Za-z0-9._-]*):"
)
INSIDE = (
    "an address inside this server's network (loopback, private, link-local or reserved); "
    "the operator may allow it in GROVE_REPO_HOSTS"
)


class HostRefused(FieldError):
    """A repository URL this server will not clone from (`key`: `repository`, or `study.base`)."""


@dataclass(frozen=True)
class Remote:
    """A repository URL taken apart: its scheme, host (no brackets), port, and where the host lies in it."""

    url: str
    scheme: str
    host: str
    port: int
    span: tuple[int, int]  # the host's characters in `url`, brackets included

    def with_host(self, host: str) -> str:
        """Return the URL with its host replaced (an address: IPv6 in brackets)."""
        return self.url[: self.span[0]] + host + self.url[self.span[1] :]


@dataclass(frozen=True)
class Checked:
    """A remote that passed the policy, with the addresses it was checked at (empty: not resolved here)."""

    remote: Remote
    addresses: tuple[IPAddress, ...]


def parse(source: str) -> Remote:
    """Take a repository URL apart (https, ssh or git URLs, and scp-like `user@host:path`), or refuse it."""
    if "://" in source:
        scheme = source.split("://", 1)[0].lower()
        if scheme not in SCHEMES:
            raise HostRefused("repository", f"scheme {scheme!r} is not allowed (use https, ssh or git)")
        start = len(scheme) + 3
        end = len(source)
        for sep in "/?#":
            at = source.find(sep, start)
            if at != -1:
                end = min(end, at)
        m = _NETLOC.fullmatch(source, start, end)
        if m is None or "\\" in source:
            raise HostRefused(
                "repository",
                "cannot read the host of this URL (give [user@]host[:port] with a plain host "
                "name or address; percent-encode other characters of a user name)",
            )
        port = int(m["port"]) if m["port"] else SCHEMES[scheme]
        if not 0 < port < 65536:
            raise HostRefused("repository", f"port {port} is not a port")
        host_span = m.span("host")
    else:
        m = _SCP.match(source)
        if m is None:
            raise HostRefused("repository", "cannot read the host of this address (use user@host:path)")
        scheme, port, host_span = "ssh", SCHEMES["ssh"], m.span("host")
    host = source[host_span[0] : host_span[1]].strip("[]").lower().rstrip(".")
    if not host:
        raise HostRefused("repository", "the URL names no host")
    return Remote(source, scheme, host, port, host_span)


def allowed(settings: Settings) -> tuple[set[str], list[IPNetwork]]:
    """Return the host names and the networks `GROVE_REPO_HOSTS` lists."""
    names: set[str] = set()
    nets: list[IPNetwork] = []
    for raw in settings.repo_hosts.split(","):
        entry = raw.strip().strip("[]").lower().rstrip(".")
        if not entry:
            continue
        try:
            nets.append(ipaddress.ip_network(entry, strict=False))
        except ValueError:
            names.add(entry)
    return names, nets


def _forms(a: IPAddress) -> list[IPAddress]:
    """Return an address and the IPv4 addresses it carries (mapped, 6to4, Teredo, NAT64)."""
    forms: list[IPAddress] = [a]
    if isinstance(a, ipaddress.IPv6Address):
        if a.ipv4_mapped is not None:
            forms.append(a.ipv4_mapped)
        if a.sixtofour is not None:
            forms.append(a.sixtofour)
        if a.teredo is not None:
            forms.extend(a.teredo)
        if a in ipaddress.IPv6Network("64:ff9b::/96"):
            forms.append(ipaddress.IPv4Address(int(a) & 0xFFFFFFFF))
    return forms


def inside(a: IPAddress) -> bool:
    """Return whether an address is not one on the open internet (loopback, private, link-local, ...)."""
    return any(
        x.is_loopback or x.is_link_local or x.is_private or x.is_unspecified or x.is_multicast
        or x.is_reserved or not x.is_global
        for x in _forms(a)
    )  # fmt: skip


def _listed(a: IPAddress, nets: list[IPNetwork]) -> bool:
    return any(x in n for x in _forms(a) for n in nets if n.version == x.version)


def resolve(remote: Remote) -> tuple[IPAddress, ...]:
    """Return every address the remote's host resolves to (an address resolves to itself), or refuse."""
    try:
        infos = socket.getaddrinfo(remote.host, remote.port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        raise HostRefused("repository", f"cannot resolve host {remote.host!r} on this server") from None
    found: list[IPAddress] = []
    for info in infos:
        a = ipaddress.ip_address(str(info[4][0]).split("%", 1)[0])
        if a not in found:
            found.append(a)
    if not found:
        raise HostRefused("repository", f"cannot resolve host {remote.host!r} on this server")
    return tuple(found)


def check(settings: Settings, source: str) -> Checked:
    """Refuse a repository URL the operator's settings do not allow; return it with the addresses checked."""
    remote = parse(source)
    names, nets = allowed(settings)
    named = remote.host in names
    if (names or nets) and not named and not nets:
        raise HostRefused("repository", f"host {remote.host!r} is not in GROVE_REPO_HOSTS")
    addresses = resolve(remote)
    if (names or nets) and not named and not all(_listed(a, nets) for a in addresses):
        raise HostRefused("repository", f"host {remote.host!r} is not in GROVE_REPO_HOSTS")
    if not named and any(inside(a) and not _listed(a, nets) for a in addresses):
        raise HostRefused("repository", f"host {remote.host!r} resolves to {INSIDE}")
    return Checked(remote, addresses)


def _literal(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _bracketed(a: IPAddress) -> str:
    return f"[{a}]" if a.version == 6 else str(a)


def pinned(checked: Checked) -> tuple[str, tuple[tuple[str, str], ...]]:
    """Return the URL git clones and the config it runs with, so it connects where the check looked.

    https: curl is told the host's addresses (`http.curloptResolve`) and follows no redirect (which
    could lead anywhere); git://: the URL names the address itself. ssh resolves the name again
    itself (its known_hosts entry is by name); the check just before the clone stands for it.
    """
    remote = checked.remote
    config: list[tuple[str, str]] = []
    url = remote.url
    if remote.scheme == "https":
        config.append(("http.followRedirects", "false"))
        if checked.addresses and not _literal(remote.host):
            addresses = ",".join(_bracketed(a) for a in checked.addresses)
            written = remote.url[remote.span[0] : remote.span[1]]
            for name in dict.fromkeys((remote.host, written, written.lower())):
                config.append(("http.curloptResolve", f"{name}:{remote.port}:{addresses}"))
    elif remote.scheme == "git" and checked.addresses and not _literal(remote.host):
        url = remote.with_host(_bracketed(checked.addresses[0]))
    return url, tuple(config)


class CloneStalled(GitError):
    """A clone killed by a timeout: `first_byte` when the host sent nothing at all."""

    def __init__(self, args: list[str], seconds: float, first_byte: bool, stderr: str) -> None:
        self.seconds, self.first_byte = seconds, first_byte
        said = "no byte arrived within" if first_byte else "timed out after"
        super().__init__(args, -1, f"{said} {seconds:g}s\n{stderr}")


def clone(
    source: str,
    dest: Path,
    *,
    timeout: float,
    first_byte_timeout: float,
    checked: Checked | None = None,
) -> gitops.Repo:
    """Clone a repository URL into `dest` (replaced), giving up when the host is silent or slow.

    With `checked`, git connects to the addresses the policy checked (see `pinned`).
    """
    url, config = pinned(checked) if checked is not None else (source, ())
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    args = ["clone", "--progress", "--no-local", "--", url, str(tmp)]
    _run_clone(args, tmp, timeout=timeout, first_byte_timeout=first_byte_timeout, config=config)
    if url != source:
        gitops.git("remote", "set-url", "origin", source, cwd=tmp)
    gitops.git("config", "core.hooksPath", "/dev/null", cwd=tmp)
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)
    return gitops.Repo(dest)


def _run_clone(
    args: list[str],
    tmp: Path,
    *,
    timeout: float,
    first_byte_timeout: float,
    config: tuple[tuple[str, str], ...],
) -> None:
    """Run `git clone` and watch it: the host has spoken once git reports progress or an object lands."""
    err = bytearray()
    lock = threading.Lock()
    with subprocess.Popen(
        ["git", *args], env=gitops.git_env(config), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, start_new_session=True,
    ) as proc:  # fmt: skip
        assert proc.stderr is not None
        fd = proc.stderr.fileno()

        def read() -> None:
            while chunk := os.read(fd, 65536):
                with lock:
                    err.extend(chunk)
                    if len(err) > 256_000:  # progress lines; keep the start (the first line) and the end
                        del err[4096:-64_000]

        reader = threading.Thread(target=read, daemon=True)
        gitrun.LIVE.add(proc.pid)  # a worker told to stop kills it with the rest (gitrun.kill_all)
        started = time.monotonic()
        heard = False
        stalled: CloneStalled | None = None
        try:
            reader.start()
            while proc.poll() is None:
                try:
                    proc.wait(timeout=0.1)
                    break
                except subprocess.TimeoutExpired:
                    pass
                elapsed = time.monotonic() - started
                if not heard:
                    with lock:
                        # Git's first line ("Cloning into ...") is its own; anything after it came
                        # from the host (progress, a warning, an error), as does any object on disk.
                        first = err.find(b"\n")
                        heard = first != -1 and len(err) > first + 1
                    heard = heard or _has_objects(tmp)
                if not heard and elapsed >= first_byte_timeout:
                    stalled = CloneStalled(args, first_byte_timeout, True, "")
                elif elapsed >= timeout:
                    stalled = CloneStalled(args, timeout, False, "")
                if stalled is not None:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                    break
        except BaseException:  # a worker's time limit, say: the command does not outlive the call
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            raise
        finally:
            gitrun.LIVE.discard(proc.pid)
            reader.join(timeout=5)
        with lock:
            text = _readable(bytes(err))
        if stalled is not None:
            raise CloneStalled(args, stalled.seconds, stalled.first_byte, text)
        if proc.returncode != 0:
            raise GitError(args, proc.returncode, text)


def reachable(checked: Checked, base: str, timeout: float) -> None:
    """Ask the host for the repository's HEAD and `base` (`git ls-remote`) within `timeout` s.

    Raises HostRefused saying why not. A `base` that names a ref (not HEAD, a commit or a revision
    expression, which only a clone can check) must be one of its branches or tags (refused naming
    `study.base`).
    """
    url, config = pinned(checked)
    named = (
        base != "HEAD" and re.fullmatch(r"[\w./-]+", base) and not re.fullmatch(r"[0-9a-fA-F]{7,64}", base)
    )
    wanted = [f"refs/heads/{base}", f"refs/tags/{base}", base] if named else []
    args = ["ls-remote", "--", url, "HEAD", *wanted]  # the refs asked for only: a small answer
    try:
        proc = gitops.run_captured(["git", *args], cwd=None, env=gitops.git_env(config), timeout=timeout)
    except subprocess.TimeoutExpired:
        raise HostRefused(
            "repository", f"{checked.remote.host} did not answer within {timeout:g} s"
        ) from None
    if proc.returncode != 0:
        said = _failed(checked.remote.url, GitError(args, proc.returncode, proc.stderr[-4000:]))
        raise HostRefused("repository", said.replace("could not clone from", "cannot read the repository at"))
    refs = {line.split("\t", 1)[1] for line in proc.stdout.splitlines()[:100] if "\t" in line}
    if named and not set(wanted) & refs:
        raise HostRefused(
            "study.base", f"the repository at {checked.remote.host} has no branch or tag {base!r}"
        )


def _has_objects(tmp: Path) -> bool:
    objects = tmp / ".git" / "objects"
    try:
        return any(p.is_file() for p in objects.rglob("*"))
    except OSError:
        return False


def _readable(raw: bytes) -> str:
    """Return git's stderr without its progress lines' carriage-return redraws."""
    lines = raw.decode("utf-8", "replace").replace("\r\n", "\n").split("\n")
    return "\n".join(line.rsplit("\r", 1)[-1] for line in lines).strip()


# What went wrong, in words a viewer may read: never the network's own text.
_AUTH = (
    "authentication failed", "permission denied", "could not read username", "could not read password",
    "repository not found", "not found", "does not appear to be a git repository", "access denied",
    "not exported", "no such repository",
    "invalid username or password", "terminal prompts disabled",
)  # fmt: skip
_NETWORK = (
    "connection refused", "could not resolve", "unable to connect", "failed to connect", "couldn't connect",
    "no route to host", "network is unreachable", "connection timed out", "timed out", "name or service not known",
    "temporary failure in name resolution", "unable to access", "connect to host", "cannot assign requested address",
)  # fmt: skip
_CUT = ("hung up unexpectedly", "early eof", "connection reset", "connection closed", "unexpected disconnect")
_HTTP_AUTH = ("returned error: 401", "returned error: 403", "returned error: 404")
_TRUST = ("ssl", "certificate", "host key verification failed", "gnutls")


def failure(source: str, exc: BaseException) -> str:
    """Return the `stop_reason` of a study whose clone failed: what happened, in plain terms."""
    return str(exc) if isinstance(exc, HostRefused) else f"repository: {_failed(source, exc)}"


def _failed(source: str, exc: BaseException) -> str:
    """Return what went wrong with a clone, in plain terms (without the field it names)."""
    try:
        host = parse(source).host
    except HostRefused:
        host = ""
    where = f"could not clone from {host}" if host else "could not clone it"
    if isinstance(exc, CloneStalled):
        if exc.first_byte:
            return f"{where}: the host did not send anything within {exc.seconds:g} s"
        return f"{where}: the clone took longer than {exc.seconds:g} s"
    if not isinstance(exc, GitError):
        return f"{where}: an error on this server (see the clone worker's log)"
    text = exc.stderr.lower()
    if any(k in text for k in _CUT) and not any(k in text for k in _AUTH):
        return f"{where}: the host closed the connection before the repository arrived"
    if any(k in text for k in _HTTP_AUTH):
        return f"{where}: authentication failed or the repository does not exist"
    if any(k in text for k in _TRUST):
        return f"{where}: the host's identity (TLS certificate or ssh host key) could not be verified"
    if any(k in text for k in _NETWORK):
        return f"{where}: the host refused or could not be reached"
    if any(k in text for k in _AUTH):
        return f"{where}: authentication failed or the repository does not exist"
    return f"{where}: git could not read a repository there (see the clone worker's log)"
