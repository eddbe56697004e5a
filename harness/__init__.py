"""What the tests and the benchmarks share: processes, fakes, network tricks, waiting.

Not part of the product (the wheel leaves it out): it is imported by ``tests/`` and
``benchmarks/``, both run from the repository root (``python -m pytest``, ``python -m
benchmarks.X``). One module per role:

- ``processes``: :class:`~harness.processes.Deployment`, the processes of one run (model
  servers, gateways, fakes) with their configs and logs in one folder, stopped together;
- ``redis_server``: a real ``redis-server`` on a port of its own, killed and restarted at will;
- ``replicas``, ``replica_load``: gateway replicas sharing state through Redis over echo
  servers, and the load a load balancer in front of them would send (the chaos scenarios);
- ``fake_server``: the one fake model server (canned or echoed answers, failures on demand),
  in a thread or as a program serving several ports;
- ``servers``: real uvicorn servers in background threads, the in-thread gateway;
- ``network``: ``free_port`` and a TCP proxy that can black-hole;
- ``waiting``: ``wait_until`` (and its async twin) and reading Prometheus metrics.
"""
