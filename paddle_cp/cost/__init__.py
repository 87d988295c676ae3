"""The cost model (numpy and the standard library only, no Paddle): the layout chooser's tiles, links and packed
layouts, and the planner's attention, memory, step time and layout search. Imports nothing of paddle_cp but itself,
so the planner and the GPU scripts use it without Paddle."""
