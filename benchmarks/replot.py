"""Draw a benchmark's figures again from its recorded JSON, without running it.

    python benchmarks/replot.py inference_methods training_components diffusion_compression
"""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def replot(name: str) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    module = importlib.import_module(name)
    out = RESULTS / f"{name}.json"
    module._plot(json.loads(out.read_text()), out.with_suffix(".png"))


if __name__ == "__main__":
    for benchmark in sys.argv[1:]:
        replot(benchmark)
        print(f"replotted {benchmark}")
