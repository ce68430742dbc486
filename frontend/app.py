"""Grove's dashboard: `streamlit run frontend/app.py` (GROVE_API_URL and GROVE_TOKEN set the connection)."""

from __future__ import annotations

from pathlib import Path

import streamlit as st

from client import GroveError
from frontend import ui

HERE = Path(__file__).parent

st.set_page_config(page_title="Grove", page_icon=":material/park:", layout="wide")
ui.guard()

try:
    waiting = ui.client().approvals_waiting()
except GroveError:
    waiting = 0

ui.PAGES.update(
    studies=st.Page(
        HERE / "views/studies.py",
        title="Studies",
        icon=":material/science:",
        url_path="studies",
        default=True,
    ),
    study=st.Page(HERE / "views/study.py", title="Study", icon=":material/account_tree:", url_path="study"),
    node=st.Page(HERE / "views/node.py", title="Node", icon=":material/search:", url_path="node"),
    approvals=st.Page(
        HERE / "views/approvals.py",
        title=f"Approvals · {waiting} waiting" if waiting else "Approvals",
        icon=":material/notification_important:" if waiting else ":material/task_alt:",
        url_path="approvals",
    ),
    connection=st.Page(
        HERE / "views/connection.py", title="Connection", icon=":material/link:", url_path="connection"
    ),
)
page = st.navigation(list(ui.PAGES.values()))

with st.sidebar:
    api, token = ui.connection()
    st.caption(f"API: `{api}`")
    try:
        health = ui.client().health()
        st.caption(
            f"service: {health.get('status')} · database {health.get('database')} · redis {health.get('redis')}"
        )
    except GroveError as exc:
        st.caption(f"service: unreachable ({type(exc).__name__})")
    if token:
        try:
            who = ui.client().whoami()
            st.caption(f"signed in as {who['name']} ({', '.join(who['roles'])})")
        except GroveError:
            st.caption("signed in with a token the API does not accept")
    else:
        st.caption("no token: read-only if the API allows public reads")

page.run()
