"""The server's environment in docker-compose.yml, written from the settings' declaration so none is missed.

    python docker/compose_env.py          rewrite the block between the markers in docker-compose.yml
    python docker/compose_env.py --check  exit 1 if the file's block differs from the declaration's

Every `MHASERVE_` setting passes through from the environment (or `.env`) but those the container fixes: where the
model repository is mounted, the addresses it listens on inside the container and the ports its published ports
and healthcheck point at. A setting left unset arrives empty, which the server reads as unset: its default.
"""

from __future__ import annotations

import sys
from dataclasses import fields
from pathlib import Path

from mhaserve.server.config import ServerSettings

COMPOSE_FILE = Path(__file__).resolve().parent.parent / "docker-compose.yml"
BEGIN = "  # BEGIN settings, written by docker/compose_env.py from the server's settings"
END = "  # END settings"

# What the container sets, with why, rather than passing through.
FIXED = {
    "model_dir": ('""', "the image's default folder unset: the volume is served as a repository"),
    "model_repository": ("/models", "the models volume (/models/<model>/<version>/)"),
    "model_control_mode": ("poll", "new versions are picked up without a restart"),
    "repository_poll_secs": ("${MHASERVE_REPOSITORY_POLL_SECS:-5}", None),
    "host": ("0.0.0.0", "inside the container, for the published ports (on the host's 127.0.0.1) to reach it"),
    "metrics_host": ("0.0.0.0", None),
    # Not passed at all: the server's default ports, which the published ports and the healthcheck point at.
    "port": (None, None),
    "http_port": (None, None),
    "metrics_port": (None, None),
}


def block() -> str:
    lines, kept_out = [BEGIN], []
    for setting in fields(ServerSettings):
        env = f"MHASERVE_{setting.name.upper()}"
        value, why = FIXED.get(setting.name, (f"${{{env}:-}}", None))
        if value is None:
            kept_out.append(env)
        else:
            lines.append(f"  {env}: {value}" + (f"  # {why}" if why else ""))
    lines += [
        "  # Not passed, the server's defaults being where the published ports and the healthcheck point:",
        f"  # {', '.join(kept_out)}",
    ]
    return "\n".join([*lines, END])


def with_block(compose: str) -> str:
    start, end = compose.index(BEGIN), compose.index(END) + len(END)
    return compose[:start] + block() + compose[end:]


def main() -> int:
    compose = COMPOSE_FILE.read_text()
    written = with_block(compose)
    if "--check" in sys.argv[1:]:
        if written != compose:
            print(f"{COMPOSE_FILE.name} does not list the server's settings as declared: run python {__file__}")
            return 1
        return 0
    COMPOSE_FILE.write_text(written)
    return 0


if __name__ == "__main__":
    sys.exit(main())
