"""The site's pictures, from real runs: a server of the embedded default model (512/8) on free local ports, then
`mhaserve infer --heatmap` (one head's attention over a causal 48-token sequence), a short `mhaserve bench`
sweep with `--plot-dir`, and the sequence tutorial's own drawing block (one row a step). Run from a clone with the
export, test (or plot) extras; the images are checked in.

    .venv/bin/python docs/images/make_images.py
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
TUTORIAL = HERE.parent / "tutorials" / "sequence.md"


def main() -> None:
    from mhaserve.export.default_model import ensure_default_model
    from mhaserve.testing.server_process import ServerProcess

    with ServerProcess(ensure_default_model(), "--warmup-runs", "1") as server:
        cli = [sys.executable, "-m", "mhaserve.cli"]
        causal = HERE / "causal-48.npy"
        np.save(causal, np.tril(np.ones((1, 48, 48), dtype=bool)))
        subprocess.run([*cli, "infer", "--url", server.url, "--q-len", "48", "--mask", str(causal), "--heatmap",
                        str(HERE / "heatmap.png"), "--head", "3", "--seed", "7"], check=True)  # fmt: skip
        causal.unlink()
        subprocess.run([*cli, "bench", "--url", server.url, "--lengths", "16..128", "--concurrency", "1,4,16",
                        "--duration", "4", "--warmup", "1", "--plot-dir", str(HERE)], check=True)  # fmt: skip
        (drawing,) = [b for b in re.findall(r"```python\n(.*?)```", TUTORIAL.read_text(), re.S) if ".savefig(" in b]
        subprocess.run([sys.executable, "-c", drawing.replace("127.0.0.1:8001", server.url)], cwd=HERE, check=True)
    for name in ("heatmap.png", "latency_percentiles.png", "latency_histogram.png", "sequence_attention.png"):
        print(f"wrote {HERE / name} ({(HERE / name).stat().st_size // 1024} KiB)")


if __name__ == "__main__":
    main()
