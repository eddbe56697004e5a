"""The launcher behind ``start_app.py``: run the suite's apps in the background, watch, stop.

Modules, lowest first (each imports only modules above it):

- ``console`` — what the user reads: messages, errors, the tail of an app's log;
- ``deployment`` — the deployment file: app kinds, entries, validation, addresses;
- ``rundir`` — the run folder: records, pid and log files, the start lock;
- ``processes`` — is an app's process alive and ours; stopping its process group;
- ``launch`` — the gunicorn / streamlit command line and environment; starting one app;
- ``startup`` — bringing apps up: checks, start order, health waits, roll-back;
- ``commands`` — ``up``, ``down``, ``status``, ``start``, ``stop`` and ``logs``;
- ``cli`` — the argument parser and ``main``, which ``start_app.py`` runs.
"""
