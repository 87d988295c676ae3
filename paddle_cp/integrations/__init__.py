"""Model libraries on paddle_cp. Each folder holds every fact the core needs about one library's models and
registers them through the core's seams when imported (paddle_cp/libraries.py names the folder for the library,
and parallelize imports it on meeting one of its models); it may also run the library's own training tools
(PaddleFormers' Trainer and CLI) on paddle_cp. zoo.py: the library the tools build their models from."""
