"""A large token file: how long the server takes to read it, to start with it, and to check a call's token.

    flock /tmp/bench.lock .venv/bin/python benchmarks/bench_tokens.py [--tokens 1000000] [--rounds 3]

Writes ``--tokens`` named tokens (``clientN TOKEN``, 40-character tokens) to a temporary file, then: the median of
``--rounds`` reads of it (``load_token``); the median over 100,000 lookups of present and absent tokens
(``Tokens.holder``, what every call runs before its message is read); and, alternating, ``--rounds`` starts of
``mhaserve serve`` on the embedded default model with the file and without any token, from the command to the
serving line. Not a test: BENCHMARKS.md records the figures.
"""

from __future__ import annotations

import argparse
import secrets
import statistics
import tempfile
import time
from pathlib import Path

from mhaserve.export.default_model import ensure_default_model
from mhaserve.server.process import ServerProcess
from mhaserve.server.security import load_token


def started_in(model_dir: Path, *flags: str) -> float:
    began = time.perf_counter()
    with ServerProcess(model_dir, "--drain-seconds", "0", *flags):
        return time.perf_counter() - began


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=1_000_000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    model_dir = ensure_default_model()
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "tokens"
        tokens = [secrets.token_hex(20) for _ in range(args.tokens)]
        path.write_text("".join(f"client{n} {token}\n" for n, token in enumerate(tokens)))
        print(f"{args.tokens} tokens, {path.stat().st_size / 2**20:.1f} MiB")
        reads = []
        for _ in range(args.rounds):
            began = time.perf_counter()
            loaded = load_token(path)
            reads.append(time.perf_counter() - began)
        print(f"read: median {statistics.median(reads):.2f} s ({', '.join(f'{r:.2f}' for r in reads)})")
        present = [f"Bearer {tokens[n]}" for n in range(0, args.tokens, max(1, args.tokens // 50_000))][:50_000]
        absent = [f"Bearer {secrets.token_hex(20)}" for _ in range(50_000)]
        for kind, values in (("present", present), ("absent", absent)):
            began = time.perf_counter()
            for value in values:
                loaded.holder(value)
            print(f"lookup ({kind}): {(time.perf_counter() - began) / len(values) * 1e6:.2f} us a call")
        with_file, without = [], []
        for _ in range(args.rounds):
            with_file.append(started_in(model_dir, "--auth-token-file", str(path)))
            without.append(started_in(model_dir))
        print(
            f"start to serving: with the file median {statistics.median(with_file):.2f} s "
            f"({', '.join(f'{s:.2f}' for s in with_file)}), without a token {statistics.median(without):.2f} s "
            f"({', '.join(f'{s:.2f}' for s in without)})"
        )


if __name__ == "__main__":
    main()
