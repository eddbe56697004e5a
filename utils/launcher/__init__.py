"""The launcher behind ``start_app.py``: run the suite's apps in the background, watch, stop.

Modules, lowest first (each imports only modules above it):

- ``console`` — what the user reads: messages, errors, the tail of an app's log;
- ``deployment`` — the deployment file: app kinds, entries, validation, addresses;
"""
