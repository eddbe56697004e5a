"""Chat with the suite through the gateway: a Streamlit page (the optional ``ui`` extra).

Run it with::

    streamlit run chat_ui_app.py -- --gateway-url http://127.0.0.1:8000

or let ``python start_app.py up`` start it with the rest (the ``chat_ui`` app of
``configs/deployment.json``). Without ``--gateway-url`` the page reads
``$LLM_SUITE_GATEWAY_URL``, else uses http://127.0.0.1:8000.

Streamlit runs this script top to bottom on every interaction, so everything that must survive
a rerun (the conversation, the HTTP client) lives in ``st.session_state``. The HTTP side is
``chat_ui.gateway_client``; this file only lays out the page.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import streamlit as st

from chat_ui.gateway_client import (
    DECODING_LABELS,
    ChatClient,
    Decoding,
    DecodingMode,
    GatewayError,
    api_messages,
    gateway_url_from,
)

MAX_TOKENS_LIMIT: int = 8192


def get_client() -> ChatClient:
    """The session's gateway client, made once per session (and again if the URL changes)."""
    url = gateway_url_from(sys.argv[1:], os.environ)
    client: ChatClient | None = st.session_state.get("chat_client")
    if client is None or client.base_url != url.rstrip("/"):
        if client is not None:
            client.close()
        client = ChatClient(url)
        st.session_state["chat_client"] = client
    return client


def sidebar(client: ChatClient) -> tuple[str | None, Decoding]:
    """Model and decoding pickers; returns the chosen model (None if none) and decoding."""
    st.sidebar.header("Settings")
    st.sidebar.caption(f"Gateway: {client.base_url}")
    model: str | None = None
    try:
        models = client.list_models()
    except GatewayError as exc:
        st.error(exc.message)
        # Keep offering the models seen earlier in the session: a question sent while the
        # gateway is away then fails with its own message instead of vanishing.
        models = st.session_state.get("known_models", [])
    else:
        st.session_state["known_models"] = models
        if not models:
            st.warning(
                "The gateway serves no model right now: no healthy model server is behind it. "
                "Start one (`python start_app.py up`) and reload the page."
            )
    if models:
        model = st.sidebar.selectbox("Model", models, key="model")
    mode: DecodingMode = st.sidebar.radio(
        "Decoding",
        list(DECODING_LABELS),
        format_func=lambda m: DECODING_LABELS[m],
        key="decoding",
    )
    settings: dict[str, Any] = {"mode": mode}
    if mode == "sampling":
        settings["temperature"] = st.sidebar.slider(
            "Temperature", 0.05, 2.0, 0.7, 0.05, key="temperature"
        )
        settings["top_p"] = st.sidebar.slider("top_p", 0.05, 1.0, 0.9, 0.05, key="top_p")
    elif mode == "beam_search":
        settings["num_beams"] = st.sidebar.slider("Beams", 2, 8, 4, key="num_beams")
    settings["max_tokens"] = int(
        st.sidebar.number_input(
            "Max new tokens", min_value=1, max_value=MAX_TOKENS_LIMIT, value=256, key="max_tokens"
        )
    )
    if st.sidebar.button("Clear conversation"):
        st.session_state["history"].clear()  # in place: main() holds the same list
    return model, Decoding(**settings)


def show_entry(entry: dict[str, Any]) -> None:
    """One message of the conversation, with its stats or its error."""
    with st.chat_message(entry["role"]):
        if entry.get("content"):
            st.markdown(entry["content"])
        if entry.get("error"):
            st.error(entry["error"])
        if entry.get("stats"):
            st.caption(entry["stats"])


def answer(client: ChatClient, model: str, decoding: Decoding, history: list[dict]) -> dict:
    """Stream the answer to the conversation into an assistant message; return its entry."""
    entry: dict[str, Any] = {"role": "assistant", "model": model}
    with st.chat_message("assistant"):
        stream = client.chat(model, api_messages(history), decoding)
        try:
            st.write_stream(stream)
        except GatewayError as exc:
            st.error(exc.message)
            entry.update(content=stream.text, error=exc.message)
            return entry
        stats = stream.stats.summary() if stream.stats else ""
        stats = f"{model} · {stats}"
        st.caption(stats)
        entry.update(content=stream.text, stats=stats)
    return entry


def main() -> None:
    """Lay out the page and handle the newest message, if any."""
    st.set_page_config(page_title="LLM serving suite: chat", page_icon="💬")
    st.title("Chat")
    st.caption(
        "Answers stream from the gateway's OpenAI-compatible API; beam search goes through its "
        "native /generate."
    )
    history: list[dict[str, Any]] = st.session_state.setdefault("history", [])
    client = get_client()
    model, decoding = sidebar(client)
    for entry in history:
        show_entry(entry)
    prompt = st.chat_input(
        "Ask something" if model else "No model to talk to", disabled=model is None
    )
    if prompt and model:
        user = {"role": "user", "content": prompt}
        history.append(user)
        show_entry(user)
        history.append(answer(client, model, decoding, history))


main()
