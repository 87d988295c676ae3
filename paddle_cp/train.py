"""`python -m paddle_cp.train config.yaml [key=value ...]`: the `pcp-train` command (PaddleFormers' CLI
workflow with paddle_cp underneath, paddle_cp/integrations/: zoo.training_cli)."""
import sys

from paddle_cp.integrations.zoo import training_cli as main

if __name__ == "__main__":
    sys.exit(main())
