"""`pcp-bench` from a checkout, without installing: `python tools/bench_cp.py --help`."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from paddle_cp.tools.bench.cli import main  # noqa: E402

if __name__ == "__main__":
    main()
