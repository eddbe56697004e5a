#!/usr/bin/env bash
# Start (or stop) the small deployment that benchmarks/probe_bad_clients.py probes: one CB
# server and a gateway in front of it, under gunicorn through start_app.py, with caller keys
# and one OpenAI jumper whose key is a known fake secret (the probe looks for it everywhere).
# The configs use only keys that every version understands, so the same deployment runs from
# an old checkout (the "before" of the probe's table) and from this one.
#
#   benchmarks/probe_deploy.sh up   REPO RUN_DIR [GATEWAY_PORT] [SERVER_PORT]
#   benchmarks/probe_deploy.sh down REPO RUN_DIR
set -euo pipefail
action=$1
repo=$(cd "$2" && pwd)
run_dir=$(mkdir -p "$3" && cd "$3" && pwd)
gateway_port=${4:-18400}
server_port=${5:-18401}

if [[ $action == down ]]; then
    cd "$repo" && exec .venv/bin/python start_app.py down --run-dir "$run_dir"
fi

# A small cache and queue: the overload probe should meet the queue limit, and no prefix
# cache, so that an idle server has every KV block free (the leak check).
cat >"$run_dir/cb_server_config.json" <<EOF
{
  "model_loading_config": {"model_name_or_path": "models/SmolLM2-135M-Instruct",
                           "torch_dtype": "bfloat16", "device": "cpu", "num_threads": 1},
  "batcher_config": {"batch_max_tokens": 512, "batch_max_beams": 32, "max_num_waiting": 16},
  "cache_config": {"num_blocks": 256, "block_size": 16, "enable_prefix_caching": false},
  "serving_config": {"default_max_new_tokens": 16, "request_timeout_seconds": 120}
}
EOF
cat >"$run_dir/client_config.json" <<EOF
{
  "continuous_batching_server_urls": ["http://127.0.0.1:$server_port"],
  "api_keys": ["probe-caller-key-5b1f"],
  "openai_jumper_configs": [{"api_key": "sk-probe-SECRET-7d3e9a51c0ffee", "base_url": "http://127.0.0.1:9/v1",
                             "models": ["gpt-4o-mini"]}],
  "heart_beat_interval_seconds": 2,
  "config_watch_interval_seconds": 0
}
EOF
cat >"$run_dir/deployment.json" <<EOF
{"apps": [
  {"name": "cb_server", "app": "cb_server", "config": "$run_dir/cb_server_config.json",
   "host": "127.0.0.1", "port": $server_port, "workers": 1},
  {"name": "client", "app": "client", "config": "$run_dir/client_config.json",
   "host": "127.0.0.1", "port": $gateway_port, "workers": 1}
]}
EOF
cd "$repo"
exec .venv/bin/python start_app.py up --deployment "$run_dir/deployment.json" --run-dir "$run_dir"
