"""`ib broker`: the embedded Valkey broker, in the foreground."""

from __future__ import annotations

import time

from ops.console import console, stop_on_sigterm
from ops.local.broker import EmbeddedBroker


def broker(port: int = 16379) -> None:
    """Run the embedded Valkey broker (append-only, in the data directory) until Ctrl-C."""
    stop_on_sigterm()
    try:
        with EmbeddedBroker(port=port) as b:
            console.print(f"embedded Valkey at {b.url} (data: {b.data_dir}); Ctrl-C stops it")
            while b.running:
                time.sleep(1)
    except KeyboardInterrupt:
        pass  # the with-block has stopped the server
