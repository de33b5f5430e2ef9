#!/usr/bin/env bash
# Start-up script for one Ironwood TPU VM (tpu7x, 2x2x1) serving without Kubernetes:
#   gcloud compute tpus tpu-vm create NAME --accelerator-type=tpu7x-8 ... \
#     --metadata-from-file=startup-script=deploy/tpu_vm_startup.sh
# Installs the repo (tpu + ray extras) into /opt/sglang-tpu-backend/.venv, starts a one-node
# Ray cluster and deploys deploy/serve_config.yaml (port 8000). REPO_URL / MODEL_DIR may be
# set in the VM metadata environment.
set -euo pipefail
REPO_URL=${REPO_URL:-https://github.com/OWNER/sglang-tpu-backend.git}
APP_DIR=/opt/sglang-tpu-backend
MODEL_DIR=${MODEL_DIR:-/models}
if [ ! -d "$APP_DIR" ]; then
  git clone --depth 1 "$REPO_URL" "$APP_DIR"
fi
cd "$APP_DIR"
python3.11 -m venv .venv
.venv/bin/pip install -q --upgrade pip
.venv/bin/pip install -q -e ".[tpu,ray]"
export PYTHONPATH="$APP_DIR"
.venv/bin/ray start --head --dashboard-host 127.0.0.1 --disable-usage-stats
# The config names the checkpoint as /models/...: point it at MODEL_DIR.
sed "s#/models/#${MODEL_DIR%/}/#" deploy/serve_config.yaml > /tmp/serve_config.yaml
.venv/bin/serve deploy /tmp/serve_config.yaml
echo "serving on port 8000 (serve status: $APP_DIR/.venv/bin/serve status)"
