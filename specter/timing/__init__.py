"""What a run is timed by: the wall and virtual clocks, the virtual clock's cost model, and the
profiles of real GPUs, links, hosts and models that the cost model and the links are set from."""

CLOCKS = ("wall", "virtual", "as-built", "measured")  # ``clock.make_clock``'s names (no torch to read them)
