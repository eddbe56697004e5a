"""The gateway's internals, one package per job.

- ``intake``: HTTP intake (caller checks, body parsing);
- ``forwarding``: the tries of one backend after another (``tries``), serving failover
  (``failover``) and stream resumes (``resume``), one attempt on one backend (``attempt``) and
  stream relaying (``stream_relay``);
- ``balancing``: the backend registry and its heartbeats, the balancing policies, the router;
- ``backends``: what every backend shares (health, lease, plan, status), the backend kinds
  (``backends.kinds``: one module each, listed once in ``config.kinds``) and the translations
  between APIs;
- ``triton``: Triton's wing (its API on the gateway, Triton servers as backends);
- ``config``: the gateway's config file, assembled from the kinds' sections, and its watch;
- ``gateway``: the parts wired into one object; ``gateway_request``: the one object a caller's
  request travels as; ``endpoints``: the table of endpoints; ``metrics``: Prometheus metrics.
"""
