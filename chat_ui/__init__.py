"""The chat page's HTTP client of the gateway (the page itself is ``chat_ui_app.py``)."""
