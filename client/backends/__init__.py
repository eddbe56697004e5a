"""The gateway's backends: what every backend shares (``backend``, ``health``, ``lease``,
``plan``, ``status``), the kinds (``kinds``: one module each, listed once in its table), and
the translations between APIs (``translation``: one interface for both directions)."""
