"""Run untrusted commands in a box: Linux namespaces through bubblewrap, limits, capped output.

Every evaluation and every command an executor runs goes through `run`. In the box a command
sees its tree at `/grove/tree` (read-write, `.git` masked), an exchange folder at `/grove/out`,
the system and Python installs read-only, a private size-capped `/tmp`, a fresh `/proc` of its
own PID namespace, no network unless asked for, and nothing else: not Grove's data, clones,
other trees, home directory or processes. When Grove runs as root the box runs as an
unprivileged uid leased for the run, so that the process limit holds. See docs/security.md.

The package's face is below; its parts are `limits` (what a run may use and the isolation settings),
`mounts` (what a box sees), `disk` (handing over, reclaiming and counting a tree), `process` (limits,
captures, waiting and ending), `uids` (the uid a run is leased), `seccomp` (the filter) and `box`
(one run as named steps).
"""

from backend.engine.sandbox.box import UNSANDBOXED_WARNING as UNSANDBOXED_WARNING
from backend.engine.sandbox.box import check as check
from backend.engine.sandbox.box import run as run
from backend.engine.sandbox.box import warm as warm
from backend.engine.sandbox.disk import MAX_DEPTH as MAX_DEPTH
from backend.engine.sandbox.disk import TOO_DEEP as TOO_DEEP
from backend.engine.sandbox.disk import usage as usage
from backend.engine.sandbox.limits import TREE as TREE
from backend.engine.sandbox.limits import Boxing as Boxing
from backend.engine.sandbox.limits import Isolation as Isolation
from backend.engine.sandbox.limits import Limits as Limits
from backend.engine.sandbox.limits import Result as Result
from backend.engine.sandbox.limits import SandboxUnavailable as SandboxUnavailable
from backend.engine.sandbox.mounts import WRAPPER_PROCESSES as WRAPPER_PROCESSES
from backend.engine.sandbox.process import kill_all as kill_all
