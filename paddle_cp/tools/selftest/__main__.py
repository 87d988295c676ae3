"""python -m paddle_cp.tools.selftest: pcp-selftest."""
import sys

from paddle_cp.tools.selftest.cli import main

sys.argv[0] = "pcp-selftest"  # its usage and progress lines under the command's name
main()
