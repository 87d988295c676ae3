"""pcp-train's `custom_register_path` hook in the tests (PaddleFormers' parser runs the file on every rank): rank 1
kills itself with SIGKILL as step 3 starts, once per PCP_KILL_MARKER (the file it leaves): the same command run
again trains on."""
import os
import signal

import paddle.distributed as dist

from paddle_cp.integrations.paddleformers.trainer import Trainer

MARKER = os.environ["PCP_KILL_MARKER"]
STEPS_DONE = 2
training_step = Trainer.training_step


def killed_once_in_step_3(self, *args, **kwargs):
    if self.state.global_step == STEPS_DONE and dist.get_rank() == 1 and not os.path.exists(MARKER):
        open(MARKER, "w").close()
        os.kill(os.getpid(), signal.SIGKILL)
    return training_step(self, *args, **kwargs)


Trainer.training_step = killed_once_in_step_3
