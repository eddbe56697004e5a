"""HTTP intake of the gateway: caller keys, body limits and parsing, the Triton generate API."""
