"""`python -m paddle_cp.train config.yaml [key=value ...]`: the `pcp-train` command (PaddleFormers' CLI
workflow with paddle_cp underneath, paddle_cp/integrations/paddleformers/cli.py)."""
import sys

from paddle_cp.integrations.paddleformers.cli import main

if __name__ == "__main__":
    sys.exit(main())
