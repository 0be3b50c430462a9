"""Where every benchmark writes its result: ``<out>/<name>-<time>.json``, with the run's
arguments and the hardware it ran on, so a number is never quoted without its machine."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from workers.lifecycle import hardware


def save(name: str, args: argparse.Namespace, **payload: Any) -> Path:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    record = {
        "bench": name,
        "time": time.time(),
        "args": vars(args),
        "hardware": hardware.detect(False).model_dump(),
        **payload,
    }
    path.write_text(json.dumps(record, indent=2))
    return path
