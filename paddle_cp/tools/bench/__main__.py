"""python -m paddle_cp.tools.bench: pcp-bench."""
import sys

from paddle_cp.tools.bench.cli import main

sys.argv[0] = "pcp-bench"  # its usage and progress lines under the command's name
main()
