"""`up` warns when a gateway's config lists a server that is no app of the deployment and
where nothing answers (a port changed in one file and not in the other)."""

from __future__ import annotations

import json
from pathlib import Path

from harness.fake_server import FakeServerSettings, start_fake_server
from harness.servers import reserve_socket
from launcher.deployment import AppEntry
from launcher.wiring_check import unmatched_gateway_urls


def test_a_gateway_url_matching_nothing_is_reported(tmp_path: Path) -> None:
    with reserve_socket() as app_port, reserve_socket() as stale_port:
        outside = start_fake_server(FakeServerSettings(model_id="m"))  # not in the deployment
        try:
            app, stale = app_port.getsockname()[1], stale_port.getsockname()[1]
            config = tmp_path / "client.json"
            config.write_text(
                json.dumps(
                    {
                        "continuous_batching_server_urls": [f"http://127.0.0.1:{stale}"],
                        "static_batching_server_urls": [f"http://127.0.0.1:{app}", outside.url],
                    }
                )
            )
            entries = [
                AppEntry(name="sb", app="sb_server", port=app),
                AppEntry(name="gw", app="client", config=str(config), port=1),
            ]
            warnings = unmatched_gateway_urls(entries)
        finally:
            outside.stop()
    assert len(warnings) == 1, warnings
    assert f"http://127.0.0.1:{stale}" in warnings[0] and str(config) in warnings[0]
