"""python -m paddle_cp.tools.elastic: pcp-launch."""
import sys

from paddle_cp.tools.elastic.cli import main

sys.exit(main())
