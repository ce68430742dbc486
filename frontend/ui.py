"""Shared dashboard pieces: the connection, error display, links between pages, formatting."""

from __future__ import annotations

import os
import re
import secrets
import statistics
import time
from collections.abc import Callable, Mapping
from typing import Any
from urllib.parse import urlsplit

import streamlit as st
from streamlit import components

from client import ApiError, Forbidden, Grove, Unauthorized, Unreachable, from_env

FINISHED = ("finished", "failed")
PAGES: dict[str, Any] = {}


LOCAL_HOSTS = frozenset({"localhost", "127.0.0.1", "::1"})


def allowed_hosts() -> frozenset[str]:
    """Return the host names the dashboard answers to: loopback and `GROVE_DASHBOARD_HOSTS`."""
    extra = os.environ.get("GROVE_DASHBOARD_HOSTS", "")
    return LOCAL_HOSTS | {h.strip().lower() for h in extra.split(",") if h.strip()}


def _hostname(netloc: str) -> str:
    return (urlsplit(f"//{netloc}").hostname or "").lower()


def host_allowed(headers: Mapping[str, str], allowed: frozenset[str]) -> bool:
    """Return whether a request's Host (and Origin, if any) name an allowed host (DNS rebinding)."""
    lowered = {k.lower(): v for k, v in headers.items()}
    host = lowered.get("host")
    if host is None:
        return True  # not from a browser: browsers always send Host
    if _hostname(host) not in allowed:
        return False
    origin = lowered.get("origin")
    return not origin or _hostname(urlsplit(origin).netloc) in allowed


def guard() -> None:
    """Stop rendering for a request addressed to a host name the dashboard does not answer to."""
    headers = dict(st.context.headers)
    if not host_allowed(headers, allowed_hosts()):
        st.error(
            f"Refused: this dashboard does not answer to host {headers.get('Host', '')!r}. "
            "Open it as localhost or 127.0.0.1, or list the name in GROVE_DASHBOARD_HOSTS."
        )
        st.stop()


COOKIE = "grove_session"
SIGN_IN_DAYS = 7


@st.cache_resource
def _signed_in() -> dict[str, tuple[str, str, float]]:
    """Sign-ins kept by the dashboard process: session id -> (API URL, token, expiry)."""
    return {}


def connection() -> tuple[str, str]:
    """Return the API URL and token this browser session uses (a sign-in survives a reload)."""
    if "api_url" not in st.session_state:
        kept = _signed_in().get(st.context.cookies.get(COOKIE) or "")
        if kept is not None and kept[2] > time.time():
            st.session_state.api_url, st.session_state.token = kept[0], kept[1]
        else:
            st.session_state.api_url, st.session_state.token = from_env()
    return st.session_state.api_url, st.session_state.token


# Writes the session cookie in the page itself (not in an iframe that a reload or rerun can drop
# before its script runs), then says so: the sentence shows only once the browser holds the cookie.
_KEEP_IN_BROWSER = components.v2.component(
    "grove_keep_sign_in",
    html="<small class='kept'></small>",
    js="""
export default function ({ data, parentElement }) {
  document.cookie = data.cookie;
  const held = document.cookie.split("; ").includes(data.pair);
  parentElement.querySelector(".kept").textContent = held
    ? "This browser stays signed in across reloads."
    : "This browser refused the sign-in cookie: a reload signs out.";
}
""",
)


def sign_in(api: str, token: str) -> None:
    """Use this API and token for the session, and keep them for this browser across reloads.

    The token stays in the dashboard's process: the browser's cookie holds only a random id.
    The page says "This browser stays signed in across reloads." once the cookie is written.
    """
    st.session_state.api_url, st.session_state.token = api, token
    kept = _signed_in()
    now = time.time()
    for sid in [k for k, v in kept.items() if v[2] <= now]:
        del kept[sid]
    sid = secrets.token_urlsafe(32)
    kept[sid] = (api, token, now + SIGN_IN_DAYS * 86400)
    pair = f"{COOKIE}={sid}"
    _KEEP_IN_BROWSER(
        key="keep_sign_in",
        data={"pair": pair, "cookie": f"{pair}; Path=/; Max-Age={SIGN_IN_DAYS * 86400}; SameSite=Strict"},
    )


@st.cache_resource(max_entries=32)
def _client(api: str, token: str) -> Grove:
    return Grove(api, token)


def client() -> Grove:
    """Return the API client for this session's connection."""
    return _client(*connection())


def show_error(exc: Exception) -> None:
    """Explain an API failure in words a user can act on."""
    if isinstance(exc, Unreachable):
        st.error(f"{exc}. Is the service running (`grove up`)? Check the API URL on the Connection page.")
    elif isinstance(exc, Unauthorized):
        st.error(
            f"The API refused the token ({exc.message}). Sign in with a valid token on the Connection page."
        )
    elif isinstance(exc, Forbidden):
        st.error(f"Not allowed: {words(exc.message)}.")
    elif isinstance(exc, ApiError):
        st.error(words(str(exc)))
    else:
        raise exc


def guarded(body: Callable[[], None]) -> None:
    """Run a page body, turning API failures into messages instead of tracebacks."""
    try:
        body()
    except (Unreachable, ApiError) as exc:
        show_error(exc)


def page_link(page: str, label: str, **params: int | str) -> None:
    """Link to another page of the app with query parameters."""
    st.page_link(PAGES[page], label=label, query_params={k: str(v) for k, v in params.items()})


def query_int(name: str) -> int | None:
    """Return an integer query parameter, or None."""
    raw = st.query_params.get(name)
    try:
        return int(raw) if raw is not None else None
    except ValueError:
        return None


def fmt(x: float | None, signed: bool = False) -> str:
    """Format a score for display."""
    if x is None:
        return "—"
    return f"{x:+.4f}" if signed else f"{x:.4f}"


def spread(values: list[float]) -> str:
    """Return '± std (n=k)' of values (sample standard deviation)."""
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"± {sd:.4f} (n={len(values)})"


def mean_std(values: list[float]) -> str:
    """Return 'mean ± std (n=k)' of values."""
    return f"{statistics.fmean(values):.4f} {spread(values)}" if values else "—"


def remember(key: str, kind: str, text: str) -> None:
    """Keep a message for the next run (the answer to an action that reruns the page)."""
    st.session_state[f"msg:{key}"] = (kind, text)


def recall(key: str, keep: bool = True) -> None:
    """Show the message kept under `key`, if any (once only, unless `keep`)."""
    kind, text = (
        st.session_state.get(f"msg:{key}", (None, ""))
        if keep
        else st.session_state.pop(f"msg:{key}", (None, ""))
    )
    show = {"success": st.success, "info": st.info, "warning": st.warning, "error": st.error}.get(kind or "")
    if show is not None:
        show(text)


# Any ASCII punctuation character may be backslash-escaped in CommonMark; these, escaped, cannot
# start a link, an image, an autolink (`www.`, `https:`, `a@b.c`), HTML, a formula (`$`), a
# Streamlit directive (`:red[...]`), emphasis or a list.
_PUNCTUATION = re.compile(r"([!#$&()*+\-./:<=>@\[\\\]^_`{|}~])")

# Streamlit links bare URLs, `www.` names and e-mail addresses in the text an escape leaves (after
# parsing, so escapes cannot stop it): an invisible word joiner after `://`'s colon, `www` and `@`
# breaks each pattern.
_AUTOLINK = re.compile(r"(?i)([a-z][a-z0-9+.-]*:(?=//)|\bwww(?=\.)|@)")


def words(text: str) -> str:
    """Return text for a Markdown element that shows it as written: no image, link, HTML or formula comes of it.

    Every page passes model-written and repository-written text (titles, hypotheses, reflections,
    summaries, failures, commands, paths) through this before Streamlit renders it as Markdown.
    """
    lines = str(text).replace("\r\n", "\n").split("\n")
    return "  \n".join(_PUNCTUATION.sub(r"\\\1", _AUTOLINK.sub("\\1\u2060", line)) for line in lines)


def report_html(text: str) -> str:
    """Return a Markdown report as HTML with its images, links, autolinks and raw HTML left as text."""
    from markdown_it import MarkdownIt

    md = MarkdownIt("commonmark", {"html": False, "linkify": False}).enable("table")
    md.disable(["image", "link", "autolink", "html_inline", "html_block"])
    style = "<style>.grove-report table{border-collapse:collapse}.grove-report td,.grove-report th{border:1px solid #ccc;padding:2px 8px}</style>"
    return f'{style}<div class="grove-report">{md.render(text)}</div>'
