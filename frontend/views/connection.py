"""Connection: the API URL and the token this browser session uses."""

from __future__ import annotations

import streamlit as st

from client import ApiError, Grove, Unreachable
from frontend import ui

st.title("Connection")
api, token = ui.connection()
st.write("The dashboard talks only to Grove's REST API. `grove up` prints the URL and a token.")
new_api = st.text_input("API URL", value=api, key="conn_api")
# The token in use stays on the server: the field starts empty, so no page ever carries it.
new_token = st.text_input(
    "Token",
    value="",
    type="password",
    key="conn_token",
    placeholder="signed in; paste another token to switch" if token else "",
    help="from `grove token create`",
)
if st.button("Connect", key="connect", type="primary"):
    # An empty field keeps the token in use, but only for the same API: never send it elsewhere.
    chosen = new_token.strip() or (token if new_api.rstrip("/") == api.rstrip("/") else "")
    probe = Grove(new_api, chosen)
    try:
        probe.health()
        n = probe.check()
    except Unreachable as exc:
        st.error(f"{exc}. Check the URL, and that the service is running.")
    except ApiError as exc:
        if exc.status == 401:
            st.error(f"The API refused this token: {exc.message}.")
        else:
            st.error(str(exc))
    else:
        who = probe.whoami() if chosen else {"name": "anonymous", "roles": ["viewer"]}
        st.success(
            f"Connected to {new_api} as {who['name']} ({', '.join(who['roles'])}): {n} studies visible."
        )
        ui.sign_in(new_api.rstrip("/"), chosen)  # then says whether this browser keeps the sign-in
    finally:
        probe.close()
