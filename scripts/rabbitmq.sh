#!/usr/bin/env bash
# A RabbitMQ for the broker test (tests/integration/test_brokers.py) at 127.0.0.1:5672:
# nothing to do when one answers; else start the installed server, installing Debian's
# rabbitmq-server first if needed (root or sudo).
set -euo pipefail
up() { (exec 3<>/dev/tcp/127.0.0.1/5672) 2>/dev/null; }
if up; then exit 0; fi
SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi
if ! command -v rabbitmq-server >/dev/null; then
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq || true
  $SUDO apt-get install -y -qq --no-install-recommends rabbitmq-server >/dev/null
fi
$SUDO rabbitmq-server -detached || $SUDO service rabbitmq-server start
for _ in $(seq 1 60); do
  if up; then exit 0; fi
  sleep 1
done
echo "RabbitMQ did not come up on 127.0.0.1:5672" >&2
exit 1
