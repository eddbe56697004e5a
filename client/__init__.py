"""The gateway's internals, one package per job.

- ``intake``: HTTP intake (caller checks, body parsing, the Triton generate API);
- ``forwarding``: the failover loop (``failover``), one attempt on one backend (``attempt``)
  and stream relaying (``stream_relay``);
- ``balancing``: the backend registry and its heartbeats, the balancing policies, the router;
- ``backends``: the backend kinds (our servers, Triton servers, OpenAI-compatible upstreams)
  and the translations between APIs that some of them need;
- ``config``: the gateway's config file and its watch;
- ``gateway``: the parts wired into one object; ``gateway_request``: the one object a caller's
  request travels as; ``metrics``: Prometheus metrics.
"""
