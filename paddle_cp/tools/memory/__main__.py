"""python -m paddle_cp.tools.memory: pcp-memory."""
import sys

from paddle_cp.tools.memory.cli import main

sys.argv[0] = "pcp-memory"  # its usage and progress lines under the command's name
main()
