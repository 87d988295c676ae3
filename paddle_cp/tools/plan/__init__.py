"""pcp-plan (cli.py: layouts for a model and a cluster, ranked by the cost model in paddle_cp/cost/) and its parts:
a layout as parallelize's config and the PaddleFormers fields it needs (config.py), the published long-context
recipes a layout resembles (recipes.py)."""
