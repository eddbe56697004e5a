"""The gateway's backends: what every backend shares (``backend``, ``health``, ``lease``,
``plan``, ``plan_memo``, ``status``), the kinds (``kinds``: one module each, listed once in the
table of ``client.config.kinds``), and the translations between APIs (``translation``: one
interface for both directions)."""
