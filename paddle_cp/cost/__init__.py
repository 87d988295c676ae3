"""The GPU cost model (numpy only, no Paddle): tiles, links, and the packed layouts priced by them."""
