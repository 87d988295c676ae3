"""python -m paddle_cp.tools.plan: pcp-plan."""
import sys

from paddle_cp.tools.plan.cli import main

sys.argv[0] = "pcp-plan"  # its usage and progress lines under the command's name
main()
